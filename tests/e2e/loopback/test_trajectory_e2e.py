"""Trajectories and the control plane end to end: real mitmdump + addon, real HTTPS through the
proxy, the reference policy server (real Qwen3 tokenizer and chat template) playing scripts."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from polar_mitm.control import ControlClient, ControlError
from polar_mitm.store import read_table
from tests.helpers.capture_session import CHAT_URL, SCENARIO, SPAWN, chat, run_agent
from tests.helpers.clients import RUN_SHELL, grep_bytes, http_client
from tests.helpers.procs import start_policy_server
from tests.helpers.waits import wait_until

TOKEN = "ctl-s3cret-token-4f9a1c"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_policy_server(tmp_path_factory.mktemp("policy"), SCENARIO)
    yield srv
    srv.stop()


def stop_and_read(mitm) -> tuple[list[dict], list[dict]]:
    assert mitm.stop() == 0, mitm.proc.output()
    calls = sorted(
        read_table(str(mitm.output), "calls").to_pylist(), key=lambda r: r["finished_at"]
    )
    traces = read_table(str(mitm.output), "traces").to_pylist()
    return calls, traces


def check_trace(trace: dict, calls_by_id: dict[str, dict]) -> None:
    """input_ids = the last call's prompt + output; mask 1 exactly on each call's sampled tokens
    (the first call's whole prompt is context), with those tokens' logprobs; 0 elsewhere."""
    calls = [calls_by_id[c] for c in trace["call_ids"]]
    last = calls[-1]
    assert trace["input_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
    mask: list[int] = []
    logprobs: list[float] = []
    for call in calls:
        env = len(call["prompt_token_ids"]) - len(mask)
        assert env >= 0
        mask += [0] * env + [1] * len(call["output_token_ids"])
        logprobs += [0.0] * env + call["output_logprobs"]
    assert trace["loss_mask"] == mask
    assert trace["logprobs"] == pytest.approx(logprobs, abs=1e-6)
    assert trace["num_policy_tokens"] == sum(len(c["output_token_ids"]) for c in calls)
    assert trace["num_env_tokens"] == len(trace["input_ids"]) - trace["num_policy_tokens"]
    starts = [0] + [len(c["prompt_token_ids"]) + len(c["output_token_ids"]) for c in calls[:-1]]
    assert trace["call_offsets"] == starts


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- merging ------------------------------------------------------------------------------------


def test_six_turn_tool_loop_is_one_main_trace(server, make_mitm):
    mitm = make_mitm(server.url, polar_control_token=TOKEN)
    ctl = ControlClient(TOKEN, proxy=mitm.url)
    messages = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "How many lines does notes.txt have?"},
    ]
    with http_client(mitm) as client:
        replies = run_agent(client, "loop.0", messages, [RUN_SHELL])
    assert len(replies) == 6 and replies[-1]["content"].strip().startswith("notes.txt has 3")
    live = ctl.traces("loop.0")
    assert live["rollout"]["state"] == "open" and len(live["traces"]) == 1
    ended = ctl.end("loop.0", reward=1.0)
    assert (ended["state"], ended["status"], ended["reward"], ended["traces"]) == (
        "ended",
        "completed",
        1.0,
        1,
    )

    calls, traces = stop_and_read(mitm)
    assert len(calls) == 6 and all(c["status"] == "completed" for c in calls)
    [trace] = traces
    assert trace["call_ids"] == [c["call_id"] for c in calls]
    check_trace(trace, {c["call_id"]: c for c in calls})
    assert (trace["role"], trace["break_reason"], trace["parent_trace_id"]) == (
        "main",
        "first_call",
        None,
    )
    assert (trace["rollout_id"], trace["group_id"], trace["sample_index"]) == ("loop.0", "loop", 0)
    assert trace["reward"] == 1.0 and trace["status"] == "completed" and trace["revision"] == 0
    assert trace["trainable"] is True and trace["untrainable_reason"] is None
    assert trace["input_ids"] == live["traces"][0]["input_ids"]


def test_side_call_sub_agent_and_compaction(server, make_mitm):
    mitm = make_mitm(server.url, polar_control_token=TOKEN)
    main_system = {"role": "system", "content": "[main] You lead. Delegate with spawn_agent."}
    task = {"role": "user", "content": "How many lines does notes.txt have?"}
    messages = [main_system, task]
    with http_client(mitm) as client:
        first = chat(client, "combo.0", messages, [RUN_SHELL, SPAWN])
        [spawn] = first["tool_calls"]
        # the harness names the conversation on the side
        title = chat(
            client,
            "combo.0",
            [{"role": "system", "content": "[title] Write a title."}, task],
            None,
            purpose="title",
        )
        assert title["content"].strip() == "Counting lines in notes.txt"
        # the sub-agent: its own system prompt and tools
        sub_messages = [
            {"role": "system", "content": "[sub-agent] You count lines."},
            {"role": "user", "content": json.loads(spawn["function"]["arguments"])["task"]},
        ]
        sub_replies = run_agent(client, "combo.0", sub_messages, [RUN_SHELL])
        # the main agent carries on with the sub-agent's answer
        messages.append(
            {
                "role": "assistant",
                "content": first.get("content"),
                "reasoning": first.get("reasoning"),
                "tool_calls": first["tool_calls"],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": spawn["id"], "content": sub_replies[-1]["content"]}
        )
        run_agent(client, "combo.0", messages, [RUN_SHELL, SPAWN])
        # context full: the history is replaced by a summary
        compacted = [
            main_system,
            {
                "role": "user",
                "content": "[summary] A sub-agent counted 3 lines in notes.txt. Continue the task.",
            },
        ]
        run_agent(client, "combo.0", compacted, [RUN_SHELL, SPAWN])
    ControlClient(TOKEN, proxy=mitm.url).end("combo.0", reward=0.5)

    calls, traces = stop_and_read(mitm)
    by_id = {c["call_id"]: c for c in calls}
    assert len(calls) == 8
    assert [c["purpose"] for c in calls].count("title") == 1
    by_reason = {t["break_reason"]: t for t in traces}
    assert len(traces) == 4 and set(by_reason) == {
        "first_call",
        "side_call",
        "sub_agent",
        "compaction",
    }
    main, side, sub, post = (
        by_reason[r] for r in ("first_call", "side_call", "sub_agent", "compaction")
    )
    assert [t["role"] for t in (main, side, sub, post)] == ["main", "side", "sub", "main"]
    assert [len(t["call_ids"]) for t in (main, side, sub, post)] == [3, 1, 2, 2]
    for t in (side, sub, post):
        assert t["parent_trace_id"] == main["trace_id"]
        # the recorded prefix length is the true common prefix with the main chain
        first_prompt = by_id[t["call_ids"][0]]["prompt_token_ids"]
        assert t["parent_prefix_len"] == common_prefix(first_prompt, main["input_ids"]) > 0
    assert main["parent_trace_id"] is None and main["parent_prefix_len"] == 0
    # the compaction kept the system prompt and tools: its prefix is the whole system block
    assert post["parent_prefix_len"] > sub["parent_prefix_len"]
    assert json.loads(post["break_detail"])["history"] == "compacted"
    assert json.loads(sub["break_detail"])["system_changed"] is True
    for t in traces:
        check_trace(t, by_id)
        assert t["reward"] == 0.5 and t["status"] == "completed" and t["trainable"] is True
    assert sum(t["num_policy_tokens"] for t in traces) == sum(
        len(c["output_token_ids"]) for c in calls
    )


def test_a_new_user_turn_after_reasoning_rerenders_and_shutdown_writes_incomplete(
    server, make_mitm
):
    """Qwen3's template drops the reasoning of turns before the last user message: the second
    prompt does not extend the first chain, though every message was sent back as it came."""
    mitm = make_mitm(server.url)
    messages = [{"role": "user", "content": "[chat] Hi!"}]
    with http_client(mitm) as client:
        reply = chat(client, "chat.0", messages, None)
        assert reply["reasoning"].strip() == "A greeting first."
        messages += [
            {"role": "assistant", "content": reply["content"], "reasoning": reply["reasoning"]},
            {"role": "user", "content": "Are you still there?"},
        ]
        assert chat(client, "chat.0", messages, None)["content"].strip() == "Still here."
    calls, traces = stop_and_read(mitm)  # never ended: shutdown writes it as incomplete
    first, second = calls
    by_reason = {t["break_reason"]: t for t in traces}
    assert set(by_reason) == {"first_call", "rerender"}
    rerender = by_reason["rerender"]
    assert rerender["parent_trace_id"] == by_reason["first_call"]["trace_id"]
    chain1 = first["prompt_token_ids"] + first["output_token_ids"]
    assert rerender["parent_prefix_len"] == common_prefix(second["prompt_token_ids"], chain1)
    assert rerender["parent_prefix_len"] < len(chain1)
    detail = json.loads(rerender["break_detail"])
    assert detail["history"] == "kept" and detail["diverged_call_id"] == first["call_id"]
    for t in traces:
        assert t["status"] == "incomplete" and t["reward"] is None and t["role"] == "main"


def test_grpo_group_of_four(server, make_mitm, tmp_path):
    mitm = make_mitm(server.url, polar_control_token=TOKEN, polar_control_listen="127.0.0.1:0")
    url = mitm.proc.wait_for(r"control plane listening on (http://\S+)").group(1)
    ctl = ControlClient(TOKEN, url=url)  # the port of its own
    with http_client(mitm) as client:
        for i in range(4):
            chat(client, f"task.{i}", [{"role": "user", "content": f"[chat] attempt {i}"}], None)
    [group] = ctl.groups()
    assert group["group_id"] == "task" and group["size"] == 4 and group["open"] == 4
    assert [s["rollout_id"] for s in group["samples"].values()] == [f"task.{i}" for i in range(4)]
    for i in range(4):
        ctl.end(f"task.{i}", reward=i / 3)
    [group] = ctl.groups()
    assert group["ended"] == 4 and [s["reward"] for s in group["samples"].values()] == [
        i / 3 for i in range(4)
    ]
    assert [r["rollout_id"] for r in ctl.rollouts(group="task")] == [f"task.{i}" for i in range(4)]
    _, traces = stop_and_read(mitm)
    got = sorted((t["group_id"], t["sample_index"], t["reward"]) for t in traces)
    assert got == [("task", i, pytest.approx(i / 3)) for i in range(4)]


# -- the control plane --------------------------------------------------------------------------


def test_control_plane_needs_the_token(server, make_mitm):
    mitm = make_mitm(server.url, polar_control_token=TOKEN)
    with http_client(mitm) as client:
        chat(client, "auth.0", [{"role": "user", "content": "[chat] hello"}], None)
        r = client.get("http://polar.control/v1/status")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = client.post("http://polar.control/v1/pause", headers={"authorization": "Bearer nope"})
        assert r.status_code == 401
        # HTTPS to the reserved host works too (the proxy's CA); nothing is dialed
        r = client.get(
            "https://polar.control/v1/status", headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert r.status_code == 200 and r.json()["paused"] is False
    wrong = ControlClient("not-the-token", proxy=mitm.url)
    for attempt in (
        wrong.pause,
        lambda: wrong.set_policy_version("v9"),
        lambda: wrong.end("auth.0", reward=1.0),
        wrong.resume,
    ):
        with pytest.raises(ControlError) as e:
            attempt()
        assert e.value.status == 401
    ctl = ControlClient(TOKEN, proxy=mitm.url)
    status = ctl.status()
    assert status["paused"] is False and status["policy_version"] is None
    assert [(r["rollout_id"], r["state"]) for r in ctl.rollouts()] == [("auth.0", "open")]
    with pytest.raises(ControlError) as e:
        ctl.end("no-such-rollout")
    assert e.value.status == 404
    with pytest.raises(ControlError) as e:
        ctl.end("auth.0", status="great")
    assert e.value.status == 400
    _, traces = stop_and_read(mitm)
    assert [t["status"] for t in traces] == ["incomplete"]  # the wrong token ended nothing
    assert grep_bytes(mitm.output, [TOKEN]) == {}

    off = make_mitm(server.url)  # no polar_control_token: the control plane is off
    with pytest.raises(ControlError) as e:
        ControlClient(TOKEN, proxy=off.url).status()
    assert e.value.status == 403 and "polar_control_token" in e.value.message


def test_pause_holds_new_calls_while_in_flight_ones_finish(server, make_mitm):
    httpx.post(server.url + "/_polar/reset", timeout=10).raise_for_status()
    mitm = make_mitm(server.url, polar_control_token=TOKEN, polar_policy_version="v1")
    ctl = ControlClient(TOKEN, proxy=mitm.url)
    first_chunk, results = threading.Event(), {}

    def in_flight() -> None:
        body = {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "[hold] go"}],
        }
        with (
            http_client(mitm) as c,
            c.stream(
                "POST", CHAT_URL, json=body, headers={"authorization": "Bearer polar-pz.0"}
            ) as r,
        ):
            text = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
                    text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
            results["held"] = "".join(text)

    def new_call() -> None:
        with http_client(mitm) as c:
            results["new"] = chat(
                c, "pz.1", [{"role": "user", "content": "[chat] after the pause"}], None
            )

    held = threading.Thread(target=in_flight)
    held.start()
    assert first_chunk.wait(20), "the held stream did not start"
    paused = ctl.pause()
    assert paused["paused"] is True and paused["in_flight"] == 1 and paused["drained"] is False
    waiter = threading.Thread(target=new_call)
    waiter.start()
    wait_until(lambda: ctl.status()["waiting"] == 1, "the new call to wait at the pause")
    ctl.set_policy_version("v2")  # the weight sync, while the held call is still streaming
    httpx.post(server.url + "/_polar/release", timeout=10).raise_for_status()
    held.join(20)
    assert not held.is_alive() and results["held"].strip() == "one two three four five"
    assert ctl.pause(wait_s=10)["drained"] is True
    waiter.join(0.5)
    assert waiter.is_alive() and "new" not in results  # still held at the pause
    chats = [
        r
        for r in httpx.get(server.url + "/_polar/requests", timeout=10).json()
        if r["path"] == "/v1/chat/completions"
    ]
    assert len(chats) == 1, "the paused call reached the policy server"
    assert ctl.resume()["released"] == 1
    waiter.join(20)
    assert not waiter.is_alive() and results["new"]["content"].strip() == "Hello there."
    for rollout in ("pz.0", "pz.1"):
        ctl.end(rollout, reward=1.0)

    calls, traces = stop_and_read(mitm)
    versions = {
        c["rollout_id"]: (c["policy_version"], c["policy_version_end"], c["trainable"])
        for c in calls
    }
    # a call's own `trainable` judges its tokens; the version span is the trace's business
    assert versions == {"pz.0": ("v1", "v2", True), "pz.1": ("v2", "v2", True)}
    by_rollout = {t["rollout_id"]: t for t in traces}
    assert by_rollout["pz.0"]["trainable"] is False
    assert by_rollout["pz.0"]["untrainable_reason"].startswith("policy_mixed")
    assert by_rollout["pz.0"]["policy_versions"] == ["v1", "v2"]
    assert by_rollout["pz.1"]["trainable"] is True and by_rollout["pz.1"]["policy_versions"] == [
        "v2"
    ]


def test_idle_timeout_ends_a_rollout_and_a_late_reward_writes_a_revision(server, make_mitm):
    mitm = make_mitm(server.url, polar_control_token=TOKEN, polar_rollout_idle="0.3")
    ctl = ControlClient(TOKEN, proxy=mitm.url)
    with http_client(mitm) as client:
        chat(client, "idle.0", [{"role": "user", "content": "[chat] hi"}], None)
    ended = wait_until(
        lambda: (r := ctl.rollout("idle.0"))["state"] == "ended" and r, "the idle end"
    )
    assert ended["status"] == "completed" and ended["reward"] is None and ended["revision"] == 0
    late = ctl.end("idle.0", reward=2.0)
    assert late["revision"] == 1 and late["reward"] == 2.0
    _, traces = stop_and_read(mitm)
    [trace] = traces  # the reader keeps the highest revision
    assert trace["revision"] == 1 and trace["reward"] == 2.0 and trace["status"] == "completed"
