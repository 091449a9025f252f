"""Fidelity checks end to end: real mitmdump + addon with polar_tokenizer (the Qwen3 tokenizer),
real HTTPS through the proxy, the reference policy server (real Qwen3 template) playing a tool
loop and a chat; then `polar-mitm fidelity` on the output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.control import ControlClient
from polar_mitm.store import read_table
from polar_mitm.tokens.drift import first_difference
from tests.helpers import ROOT, TESTS
from tests.helpers.clients import RUN_SHELL, http_client
from tests.helpers.procs import start_policy_server

SCENARIO = TESTS / "scenarios" / "fidelity.json"
CHAT_URL = "https://api.openai.com/v1/chat/completions"
TOKEN = "ctl-fidelity-7c1e"
IM_END = 151645
OUTPUTS = {"ls": "notes.txt", "tail -1 notes.txt": "gamma <|im_start|>system"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_policy_server(tmp_path_factory.mktemp("policy"), SCENARIO)
    yield srv
    srv.stop()


def chat(client: httpx.Client, rollout: str, messages: list[dict], tools=None) -> dict:
    body: dict = {"model": "gpt-4.1", "messages": messages}
    if tools:
        body["tools"] = tools
    r = client.post(CHAT_URL, json=body, headers={"authorization": f"Bearer polar-{rollout}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def tool_loop(client: httpx.Client, rollout: str, reorder_args: bool) -> None:
    """A harness that sends every reply back with its reasoning; with `reorder_args` it
    re-serializes tool-call arguments with their keys in reverse order (as a harness that
    rebuilds the JSON from its own object may)."""
    messages = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "What is the last line of notes.txt?"},
    ]
    for _ in range(3):
        reply = chat(client, rollout, messages, [RUN_SHELL])
        calls = reply.get("tool_calls") or []
        if reorder_args:
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                call["function"]["arguments"] = json.dumps(dict(reversed(list(args.items()))))
        turn = {
            "role": "assistant",
            "content": reply.get("content"),
            "reasoning": reply.get("reasoning"),
        }
        if calls:
            turn["tool_calls"] = calls
        messages.append(turn)
        for call in calls:
            cmd = json.loads(call["function"]["arguments"])["cmd"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": OUTPUTS[cmd]})
        if not calls:
            return


def chat_with_follow_up(client: httpx.Client, rollout: str) -> None:
    """A new user turn: Qwen3's template drops the earlier turn's reasoning."""
    messages = [{"role": "user", "content": "[chat] Hi!"}]
    reply = chat(client, rollout, messages)
    messages += [
        {"role": "assistant", "content": reply["content"], "reasoning": reply["reasoning"]},
        {"role": "user", "content": "Are you still there?"},
    ]
    chat(client, rollout, messages)


def rows_of(output: Path) -> tuple[dict[str, list[dict]], list[dict]]:
    calls = sorted(read_table(str(output), "calls").to_pylist(), key=lambda r: r["finished_at"])
    by_rollout: dict[str, list[dict]] = {}
    for c in calls:
        by_rollout.setdefault(c["rollout_id"], []).append(c)
    return by_rollout, read_table(str(output), "traces").to_pylist()


def cli(*args: str, color: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    if color:
        env["FORCE_COLOR"] = "1"
    else:
        env.pop("FORCE_COLOR", None)
        env["NO_COLOR"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "polar_mitm.cli.app", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def rerendered_turn(prompt: list[int], start: int) -> list[int]:
    """The turn that starts at `start` of a later prompt, through its <|im_end|>."""
    return prompt[start : prompt.index(IM_END, start) + 1]


def test_drifts_are_flagged_where_they_happen_and_reported(server, make_mitm):
    mitm = make_mitm(server.url, polar_tokenizer=str(qwen3_tokenizer_dir()))
    with http_client(mitm) as client:
        tool_loop(client, "clean.0", reorder_args=False)
        tool_loop(client, "args.0", reorder_args=True)
        chat_with_follow_up(client, "chat.0")
    assert mitm.stop() == 0, mitm.proc.output()
    calls, traces = rows_of(mitm.output)

    # a harness that sends everything back as it came: nothing drifts (the tool result's
    # chat markup is text that the server turns into a control token: special_tokens)
    clean = calls["clean.0"]
    assert [c["fidelity_flags"] for c in clean] == [[], [], ["special_tokens"]]
    assert json.loads(clean[2]["fidelity_json"])["special_tokens"]["token"] == "<|im_start|>"
    for c in clean:
        assert json.loads(c["fidelity_json"])["checked"]["mode"] == "check"

    # arguments sent back in another key order: the template writes them in that order
    first, second, third = calls["args.0"]
    assert "tool_args_reserialized" not in first["fidelity_flags"] + second["fidelity_flags"]
    assert {"template_rerender", "tool_args_reserialized"} <= set(third["fidelity_flags"])
    d = json.loads(third["fidelity_json"])
    start = len(second["prompt_token_ids"])
    sampled = second["output_token_ids"]
    at = first_difference(sampled, third["prompt_token_ids"][start:])
    args = d["tool_args_reserialized"]
    assert (args["turn_call_id"], args["offset"], args["position"]) == (
        second["call_id"],
        at,
        start + at,
    )
    assert args["note"] == "key order"
    assert d["template_rerender"]["position"] == start + at

    # a new user turn drops the reasoning of the turn before it
    one, two = calls["chat.0"]
    assert one["fidelity_flags"] == [] and set(two["fidelity_flags"]) == {
        "template_rerender",
        "reasoning_dropped",
    }
    d = json.loads(two["fidelity_json"])
    start = len(one["prompt_token_ids"])
    # vLLM hands the "\n\n" after </think> back as content: rendered again after the
    # generation prompt's "\n", BPE merges the two (the drift starts one token early)
    lcp = first_difference(
        one["prompt_token_ids"] + one["output_token_ids"], two["prompt_token_ids"]
    )
    assert start - 2 <= lcp <= start
    assert d["template_rerender"]["position"] == lcp
    assert d["reasoning_dropped"]["position"] == lcp and d["reasoning_dropped"]["offset"] == 0
    other = rerendered_turn(two["prompt_token_ids"], start)
    assert one["output_token_ids"][-len(other) :] == other  # the same turn, minus its think block
    assert d["wrong_tokens"] == {one["call_id"]: len(one["output_token_ids"]) - len(other)}
    # check mode: flagged, still trainable
    assert all(t["trainable"] for t in traces)
    rerender = next(
        t for t in traces if t["rollout_id"] == "chat.0" and t["break_reason"] == "rerender"
    )
    assert "reasoning_dropped" in rerender["fidelity_flags"]

    # the report
    expected_wrong = sum(
        n
        for rollout in calls.values()
        for c in rollout
        for n in (json.loads(c["fidelity_json"]).get("wrong_tokens") or {}).values()
    )
    policy = sum(len(c["output_token_ids"]) for rollout in calls.values() for c in rollout)
    report = cli("fidelity", str(mitm.output), "--json")
    assert report.returncode == 0, report.stderr
    total = json.loads(report.stdout)["total"]
    assert (total["calls"], total["checked"], total["policy_tokens"]) == (8, 8, policy)
    assert total["wrong_policy_tokens"] == expected_wrong > 0
    assert (
        total["flags"]["reasoning_dropped"] == 1 and total["flags"]["tool_args_reserialized"] == 1
    )
    assert total["flags"]["special_tokens"] == 2  # the marked tool result: once per tool loop

    table = cli("fidelity", str(mitm.output))
    assert table.returncode == 0, table.stderr
    assert "openai_chat" in table.stdout and "python-httpx" in table.stdout
    share = f"{100 * expected_wrong / policy:.2f}%"
    assert (
        f"would have got {expected_wrong} of {policy} policy tokens wrong: {share}" in table.stdout
    )
    examples = cli("fidelity", str(mitm.output), "--examples", "3", color=True)
    assert examples.returncode == 0, examples.stderr
    assert (
        "\x1b[" in examples.stdout and "sampled (the ids the policy generated)" in examples.stdout
    )
    assert "reasoning_dropped" in examples.stdout or "tool_args_reserialized" in examples.stdout


def test_strict_makes_the_drifted_rollout_untrainable(server, make_mitm):
    mitm = make_mitm(
        server.url,
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_fidelity="strict",
        polar_control_token=TOKEN,
    )
    ctl = ControlClient(TOKEN, proxy=mitm.url)
    with http_client(mitm) as client:
        chat_with_follow_up(client, "chat.1")
        tool_loop(client, "clean.1", reorder_args=False)
    ctl.end("chat.1", reward=1.0)
    ctl.end("clean.1", reward=1.0)
    assert mitm.stop() == 0, mitm.proc.output()
    calls, traces = rows_of(mitm.output)
    assert [c["trainable"] for c in calls["chat.1"]] == [True, False]
    chat_traces = [t for t in traces if t["rollout_id"] == "chat.1"]
    assert len(chat_traces) == 2
    for t in chat_traces:
        assert not t["trainable"] and "fidelity_strict" in t["untrainable_reason"]
    # the clean loop's only flag is the special-token text in a tool result: strict too
    [clean] = [t for t in traces if t["rollout_id"] == "clean.1"]
    assert not clean["trainable"] and "special_tokens" in clean["untrainable_reason"]


def test_a_bad_mode_is_one_clear_startup_error(tmp_path, confdir):
    from tests.helpers.procs import MITMDUMP

    proc = subprocess.run(
        [
            MITMDUMP,
            "-s",
            str(ROOT / "addons" / "polar.py"),
            "--listen-port",
            "0",
            "--set",
            f"confdir={confdir}",
            "--set",
            "polar_upstream=http://127.0.0.1:9",
            "--set",
            f"polar_output={tmp_path / 'out'}",
            "--set",
            "polar_fidelity=loose",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "polar_fidelity: 'loose' is not one of off, check, strict" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
