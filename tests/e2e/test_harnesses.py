"""The real harnesses, unmodified, through real mitmdump with the addon, to the policy server.

Each harness (the npm binary pinned in tests/e2e/npm/) runs non-interactively in a temp workdir,
inside a network namespace whose only way out is the proxy, with nothing but the environment
`polar-mitm env` prints plus an API key `polar-<rollout id>`. The reference policy server plays a
scenario that calls the harness's own shell tool (the names and schemas recorded in
docs/harness-wire-notes.md) to create hello.txt, reads the tool result, and answers with text.

What is checked: the harness exits 0 with the scripted answer and no API error; the file exists
(the tool really ran); `calls/` has one row per LLM request the harness made, with the token ids
the server really produced; `traces/` has one main trace with the tool result as mask-0 tokens
between two mask-1 spans; other paths were answered locally and never reached the policy.
The stand-alone wire_capture.py, loaded before the addon in log-only mode, is the independent
record of what the harness sent.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from polar_mitm.addons.capture import DEFAULT_HOSTS
from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.control import ControlClient
from polar_mitm.store import read_table
from tests.helpers.clients import grep_bytes
from tests.helpers.procs import BIN

from .harnesses import FILE_NAME, FILE_TEXT, FINAL_TEXT, HARNESSES, PROMPT, run_harness

SCENARIO = Path(__file__).parent / "scenarios" / "harnesses.json"
WIRE_CAPTURE = Path(__file__).parent / "wire_capture.py"
LLM_ENDPOINTS = {"/v1/chat/completions", "/v1/responses", "/v1/responses/compact", "/v1/messages"}
# Google's endpoints end in the method, after the model name: /v1beta/models/M:generateContent
GEMINI_METHODS = (":generateContent", ":streamGenerateContent")
POLAR_HOSTS = set(DEFAULT_HOSTS.split(","))

# How each harness is identified: Codex sends no API key (docs/design.md, "Rollout identity"), so
# its rollout id comes from the proxy credentials; the others put theirs in the key.
ROLLOUTS = {
    "pi": ("harness-pi.0", "api_key"),
    "codex": ("harness-codex.1", "proxy_auth"),
    "claude": ("harness-claude.2", "api_key"),
    "qwen": ("harness-qwen.3", "api_key"),
    "opencode": ("harness-opencode.4", "api_key"),
    "gemini": ("harness-gemini.5", "api_key"),  # x-goog-api-key
    "mini-swe-agent": ("harness-mini.6", "api_key"),
    "openhands": ("harness-openhands.7", "api_key"),
    "hermes": ("harness-hermes.8", "api_key"),
    "cline": ("harness-cline.9", "api_key"),
    "kilo": ("harness-kilo.10", "api_key"),
    "aider": ("harness-aider.11", "api_key"),
    "openclaw": ("harness-openclaw.12", "api_key"),
}
# How each rollout ends: through the control plane with a reward (what a trainer does once it has
# scored the workdir), or, left open, at proxy shutdown as `incomplete`. Both paths are run.
REWARD = 1.0
ENDED_BY = {
    "pi": "shutdown",
    "codex": "control",
    "claude": "control",
    "qwen": "control",
    "opencode": "shutdown",
    "gemini": "control",
    "mini-swe-agent": "control",
    "openhands": "shutdown",
    "hermes": "control",
    "cline": "control",
    "kilo": "shutdown",
    "aider": "control",
    "openclaw": "control",
}
CONTROL_TOKEN = "e2e-control-token"
# vLLM's refusal of an output cap (Claude Code asks 128000): 0.33's of a cap above max_model_len,
# older vLLM's of one that does not fit beside the prompt. The proxy sends the call once more
# without the cap (docs/dialects.md, "The output cap").
CAP_REFUSED = re.compile(
    r"max_tokens' or 'max_completion_tokens' is too large|cannot be greater than max_model_len"
)
# Harnesses that hand the "\n\n" the server streams between reasoning and a tool call back as
# the assistant's content (Qwen Code, OpenCode; docs/harness-wire-notes.md): in chat mode their
# second main call re-renders the first one (see assert_rerendered). mini-SWE-agent (LiteLLM) hands
# back the content before its tool call as streamed, its trailing "\n" included, where the
# template adds one more.
HANDS_BACK_WHITESPACE = {"qwen", "opencode", "mini-swe-agent", "cline", "kilo"}
# Harnesses that edit through a text edit format, not tools: Aider makes one LLM call per
# --message (its reply is the file, in the whole-file format) and, as that format writes every
# line with its newline, the file ends in one.
ONE_CALL = {"aider"}


def file_text(name: str) -> str:
    """What the task's file holds once the harness made it."""
    return FILE_TEXT + "\n" if name in ONE_CALL else FILE_TEXT


# Log lines that are expected and are not API errors.
KNOWN_NOISE = {
    # The WebSocket attempt that polar-mitm refuses (426); Codex then uses SSE.
    "codex": [re.compile(r"ERROR codex_api::endpoint::responses_websocket: failed to connect")],
    # OpenClaw's session store maintenance worker, racing itself in a fresh state dir: logged
    # with `error="SQLite automatic maintenance inputs changed before commit"` and retried.
    "openclaw": [re.compile(r"^\[session-sqlite\] ")],
}
API_ERROR = re.compile(
    r"(?i)(api error|error:|\berror\b.*\b[45]\d\d\b|\b[45]\d\d\b.*\berror\b|stream (error|disconnected)"
    r"|unexpected status|invalid_request|server_error|reconnecting)"
)


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


@dataclass
class Observed:
    wire: list[dict]  # every request the harness sent, as the proxy's first addon saw it
    upstream: list[dict]  # every request the policy server received
    calls: list[dict]
    traces: list[dict]
    output: Path  # polar_output
    ended: dict | None  # the control plane's answer to ending the rollout, if it was ended so


def polar_env(proxy: str, confdir: Path, rollout: str | None) -> str:
    args = [str(BIN / "polar-mitm"), "env", "--proxy", proxy, "--confdir", str(confdir)]
    if rollout:
        args += ["--rollout", rollout]
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def is_llm_request(entry: dict) -> bool:
    path = entry["path"].partition("?")[0]
    llm = path in LLM_ENDPOINTS or path.endswith(GEMINI_METHODS)
    return entry["method"] == "POST" and entry["host"] in POLAR_HOSTS and llm


def requested_model(entry: dict) -> str:
    """The model the harness asked for: in the body, or (Google's API) in the path."""
    if "model" in entry["body"]:
        return entry["body"]["model"]
    return entry["path"].partition("?")[0].rpartition("/models/")[2].partition(":")[0]


def header(entry: dict, name: str) -> str | None:
    return next((v for k, v in entry["headers"] if k.lower() == name), None)


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    runs: list[tuple[int, int, int]] = []
    for i, v in enumerate(mask):
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1], i + 1)
        else:
            runs.append((v, i, i + 1))
    return runs


def assert_one_main_chain(trace: dict, main_calls: list[dict], qwen3) -> None:
    """Two main calls as one chain: prompt (0), turn 1 (1), tool result (0), turn 2 (1), with
    the calls' own ids and logprobs in place."""
    first, last = main_calls
    assert trace["call_ids"] == [r["call_id"] for r in main_calls]
    ids, mask, lps = trace["input_ids"], trace["loss_mask"], trace["logprobs"]
    assert ids == last["prompt_token_ids"] + last["output_token_ids"]
    assert len(mask) == len(ids) == len(lps)
    runs = mask_runs(mask)
    assert [v for v, _, _ in runs] == [0, 1, 0, 1], runs
    (_, _, p_end), (_, a1, a1_end), (_, r0, r_end), (_, a2, a2_end) = runs
    assert ids[:p_end] == first["prompt_token_ids"]
    assert ids[a1:a1_end] == first["output_token_ids"]
    assert ids[a2:a2_end] == last["output_token_ids"]
    assert lps[a1:a1_end] == pytest.approx(first["output_logprobs"], abs=1e-6)
    assert lps[a2:a2_end] == pytest.approx(last["output_logprobs"], abs=1e-6)
    assert all(lp == 0 for lp in lps[r0:r_end])
    tool_result = qwen3.decode(ids[r0:r_end])
    assert FILE_TEXT in tool_result and "<tool_response>" in tool_result, tool_result


def assert_one_call_chain(trace: dict, call: dict, qwen3) -> None:
    """One main call as the main chain: prompt (0), the reply (1), with the call's own ids and
    logprobs; the reply holds the file in the edit format."""
    assert trace["call_ids"] == [call["call_id"]]
    ids, mask, lps = trace["input_ids"], trace["loss_mask"], trace["logprobs"]
    assert ids == call["prompt_token_ids"] + call["output_token_ids"]
    assert len(mask) == len(ids) == len(lps)
    n = len(call["prompt_token_ids"])
    assert [v for v, _, _ in mask_runs(mask)] == [0, 1] and mask[n - 1 : n + 1] == [0, 1]
    assert lps[n:] == pytest.approx(call["output_logprobs"], abs=1e-6)
    assert f"{FILE_NAME}\n```\n{FILE_TEXT}\n```" in qwen3.decode(ids[n:])


def assert_rerendered(mains: list[dict], main_calls: list[dict], qwen3) -> None:
    """Chat mode with a harness that hands the streamed "\n\n" before a tool call back as
    content: the template renders turn 1 with one more newline than the policy sampled, so
    turn 2 starts a main chain of its own off turn 1's (`rerender`, in sampled tokens, the
    history kept). polar_exact_prefix removes it (test_harness_lineage.py)."""
    first, last = main_calls
    by_call = {t["call_ids"][0]: t for t in mains}
    assert [len(t["call_ids"]) for t in mains] == [1, 1], [t["call_ids"] for t in mains]
    one, two = by_call[first["call_id"]], by_call[last["call_id"]]
    assert one["break_reason"] == "first_call"
    assert (two["break_reason"], two["parent_trace_id"]) == ("rerender", one["trace_id"])
    detail = json.loads(two["break_detail"])
    assert (detail["diverged_in"], detail["history"]) == ("policy", "kept"), detail
    assert detail["system_changed"] is False and detail["tools_changed"] is False
    assert qwen3.decode(first["output_token_ids"]).startswith("<think>")
    # The new chain's prompt is context; the tool result is in it.
    ids, mask = two["input_ids"], two["loss_mask"]
    assert ids == last["prompt_token_ids"] + last["output_token_ids"]
    assert [v for v, _, _ in mask_runs(mask)] == [0, 1]
    assert FILE_TEXT in qwen3.decode(last["prompt_token_ids"][two["parent_prefix_len"] :])


def ask(server_url: str, body: dict) -> httpx.Response:
    """What the policy server answers to exactly this upstream body, asked directly (no proxy)."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)


def served_requests(server_url: str, upstream_chat: list[dict]) -> list[dict]:
    """The upstream requests that produced a reply, one per call: a request the server refused
    for its output cap must be followed by the same body without the cap (the proxy's retry)."""
    served: list[dict] = []
    refused: dict | None = None
    for entry in upstream_chat:
        r = ask(server_url, entry["body"])
        if r.status_code == 400 and CAP_REFUSED.search(r.text):
            assert refused is None, "two refusals in a row: the retry kept the cap"
            refused = entry["body"]
            continue
        assert r.status_code == 200, r.text
        if refused is not None:
            without = {
                k: v for k, v in refused.items() if k not in ("max_tokens", "max_completion_tokens")
            }
            assert entry["body"] == without, "the retry changed more than the cap"
            refused = None
        served.append({**entry, "answer": r.json()})
    assert refused is None, "a refused call was not retried"
    return served


def assert_exact_calls(
    seen: Observed,
    server,
    llm: list[dict],
    upstream_chat: list[dict],
    rollout: str,
    source: str,
) -> tuple[int, list[str]]:
    """`calls/` has one completed row per LLM request, in order, whose ids are exactly what the
    server produces for the body it was sent; (calls retried without the cap, their notes)."""
    served = served_requests(server.url, upstream_chat)
    assert len(seen.calls) == len(llm) == len(served), (seen.calls, llm)
    retried = len(upstream_chat) - len(served)
    notes = [n for row in seen.calls for n in row["translation_notes"] or [] if "dropped" in n]
    assert len([n for n in notes if "exceeds the model's context" in n]) == retried, notes
    for row, sent, asked in zip(seen.calls, llm, served, strict=True):
        assert row["status"] == "completed", row["error"]
        assert row["rollout_id"] == rollout and row["rollout_source"] == source
        assert row["host"] == sent["host"] and row["path"] == sent["path"].partition("?")[0]
        assert row["model_served"] == "Qwen/Qwen3-4B"
        assert row["model_requested"] == requested_model(sent)
        want = asked["answer"]
        assert row["prompt_token_ids"] == want["prompt_token_ids"]
        assert row["output_token_ids"] == want["choices"][0]["token_ids"]
        lps = [e["logprob"] for e in want["choices"][0]["logprobs"]["content"]]
        assert row["output_logprobs"] == pytest.approx(lps, abs=1e-6)
        assert row["ids_source"] == "upstream" and row["count_check"] == "ok"
        assert row["trainable"] is True
    return retried, notes


def run_through_proxy(
    name,
    harness_bin,
    netns,
    tmp_path,
    confdir,
    make_policy_server,
    make_mitm,
    server_args: tuple[str, ...] = (),
    *,
    scenario: Path = SCENARIO,
    harness=None,
    prompt: str = PROMPT,
    timeout: float = 180.0,
    end_by: str | None = None,
    mitm_options: dict[str, str] | None = None,
):
    """Run one harness through the proxy against `scenario`; what everyone saw. The keywords
    are for the long-session and lineage tests: another script, prompt or config, more proxy
    options; `server_args` go to the reference server (e.g. its --max-model-len)."""
    harness = harness or HARNESSES[name]
    rollout, source = ROLLOUTS[name]
    server = make_policy_server(scenario, *server_args)
    wire_log = tmp_path / "wire.jsonl"
    mitm = make_mitm(
        server.url,
        listen_host=netns.host_ip,
        scripts_before=[WIRE_CAPTURE],
        wire_answer="false",
        wire_log=str(wire_log),
        polar_control_token=CONTROL_TOKEN,
        **(mitm_options or {}),
    )
    env_lines = polar_env(mitm.url, confdir, rollout if source == "proxy_auth" else None)
    result = run_harness(
        harness,
        harness_bin,
        tmp_path,
        env_lines,
        f"polar-{rollout}",
        wrap=netns.wrap,
        prompt=prompt,
        timeout=timeout,
    )
    upstream = httpx.get(server.url + "/_polar/requests", timeout=10).json()
    ended = None
    if (end_by or ENDED_BY[name]) == "control" and result.returncode == 0:
        # The trainer's side: the harness is done, the workdir scored, the rollout ended.
        ended = ControlClient(CONTROL_TOKEN, proxy=mitm.url).end(rollout, reward=REWARD)
    assert mitm.stop() == 0, mitm.proc.output()
    wire = (
        [json.loads(line) for line in wire_log.read_text().splitlines()]
        if wire_log.exists()
        else []
    )
    wire = sorted((e for e in wire if e["kind"] == "request"), key=lambda e: e["order"])
    calls = sorted(read_table(str(mitm.output), "calls").to_pylist(), key=lambda r: r["started_at"])
    traces = read_table(str(mitm.output), "traces").to_pylist()
    return result, Observed(wire, upstream, calls, traces, mitm.output, ended), server


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HARNESSES))
def test_real_harness(name, harness_session, qwen3):
    rollout, source = ROLLOUTS[name]
    result, seen, server, log = harness_session(name, timeout=180)

    # The harness's own view: a normal run (it exited 0) with the scripted answer.
    assert FINAL_TEXT in result.stdout, log
    noise = KNOWN_NOISE.get(name, [])
    errors = [
        line
        for line in (result.stdout + "\n" + result.stderr).splitlines()
        if API_ERROR.search(line) and not any(p.search(line) for p in noise)
    ]
    assert errors == [], log
    # The tool really ran (Aider: its edit was applied).
    assert (result.workdir / FILE_NAME).read_text() == file_text(name), log

    # Every request the harness sent went through the proxy; LLM calls were captured, the other
    # paths of the captured hosts were answered locally and never reached the policy server.
    llm = [e for e in seen.wire if is_llm_request(e)]
    assert len(llm) >= (1 if name in ONE_CALL else 2), seen.wire
    assert all(e["status"] == 200 for e in llm), [(e["path"], e["status"]) for e in llm]
    others = [e for e in seen.wire if e["host"] in POLAR_HOSTS and not is_llm_request(e)]
    for e in others:
        websocket = (header(e, "upgrade") or "").lower() == "websocket"
        assert e["status"] == (426 if websocket else 404), e
    assert {(u["method"], u["path"]) for u in seen.upstream} <= {
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    }, seen.upstream
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]

    # calls/: one row per LLM request, in order, with exact ids.
    retried, notes = assert_exact_calls(seen, server, llm, upstream_chat, rollout, source)
    assert grep_bytes(seen.output, [f"polar-{rollout}"]) == {}  # the key never reaches disk

    # traces/: the main calls are the main chain (side calls such as titles are not in it).
    main_calls = [r for r in seen.calls if r["purpose"] == "main"]
    want = 1 if name in ONE_CALL else 2
    assert len(main_calls) == want, [(r["purpose"], r["path"]) for r in seen.calls]
    mains = [t for t in seen.traces if t["rollout_id"] == rollout and t["role"] == "main"]
    if name in HANDS_BACK_WHITESPACE:
        assert_rerendered(mains, main_calls, qwen3)
    elif name in ONE_CALL:
        assert len(mains) == 1, [(t["role"], t["call_ids"], t["break_reason"]) for t in seen.traces]
        assert_one_call_chain(mains[0], main_calls[0], qwen3)
    else:
        assert len(mains) == 1, [(t["role"], t["call_ids"], t["break_reason"]) for t in seen.traces]
        assert_one_main_chain(mains[0], main_calls, qwen3)
    for trace in mains:
        assert trace["trainable"] is True, trace["untrainable_reason"]
        if ENDED_BY[name] == "control":
            # Ended by the trainer with a reward: the trace carries it and is complete.
            assert seen.ended is not None and seen.ended["reward"] == REWARD, seen.ended
            assert (trace["status"], trace["reward"]) == ("completed", REWARD)
        else:
            # Still open when the proxy stopped: written at shutdown, incomplete, no reward.
            assert (trace["status"], trace["reward"]) == ("incomplete", None)
    sides = [t for t in seen.traces if t["role"] == "side"]
    side_calls = [
        r["call_id"] for r in seen.calls if r["purpose"] != "main" and r["route"] == "chat"
    ]
    assert sorted(c for t in sides for c in t["call_ids"]) == sorted(side_calls), seen.traces
    assert all(t["break_reason"] == "side_call" for t in sides)

    if name == "codex":
        # Codex tries a WebSocket first; refused with 426 it falls back to SSE POSTs.
        ws = [e for e in seen.wire if (header(e, "upgrade") or "").lower() == "websocket"]
        assert ws and all(e["status"] == 426 for e in ws), ws
        assert ws[0]["order"] < llm[0]["order"]
        assert header(llm[0], "authorization") is None  # no key on the wire: proxy credentials
        assert seen.calls[0]["session_id"] == header(llm[0], "session-id")
    if name == "claude":
        # max_tokens 128000 fits the policy's 131072 context (not beside the prompt): vLLM 0.33
        # clamps it, one upstream request per call (test_claude_code_output_cap: 32768).
        assert retried == 0, (retried, notes)
        assert seen.calls[0]["session_id"] == header(llm[0], "x-claude-code-session-id")
    if name == "gemini":
        check_gemini(seen, llm, trace)


def check_gemini(seen: Observed, llm: list[dict], trace: dict) -> None:
    """Gemini CLI: its model router's call (tool-less, JSON output) is a side call in a side
    chain of its own; the agent loop streams (alt=sse) and sends its key as x-goog-api-key;
    the thinking, sealed in the tool call's thoughtSignature, came back and was re-rendered."""
    [router] = [r for r in seen.calls if r["purpose"] == "side"]
    assert (
        router["path"].endswith(":generateContent")
        and router["call_id"] == seen.calls[0]["call_id"]
    )
    side = [t for t in seen.traces if router["call_id"] in t["call_ids"]]
    assert [(t["role"], t["break_reason"], t["call_ids"]) for t in side] == [
        ("side", "side_call", [router["call_id"]])
    ]
    mains = [e for e in llm if e["path"].partition("?")[0].endswith(":streamGenerateContent")]
    assert len(mains) == 2 and all(e["path"].endswith("?alt=sse") for e in mains)
    assert all(header(e, "x-goog-api-key") == "[redacted polar- key]" for e in llm)
    second = mains[1]["body"]["contents"]
    [call] = [p for c in second if c["role"] == "model" for p in c["parts"] if "functionCall" in p]
    assert call["thoughtSignature"].startswith("polar1:")
    assert not any(p.get("thought") for c in second for p in c["parts"])  # thoughts not sent back


@pytest.mark.slow
@pytest.mark.parametrize("max_model_len", [32768, 131072])
def test_claude_code_output_cap(
    max_model_len, harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm
):
    """The real Claude Code against a vLLM 0.33 reference server at the two usual contexts: its
    max_tokens=128000 is refused on 32768 (two upstream requests per call: the refusal, then
    the call without the cap) and clamped on 131072 (one); either way the task completes with
    exact ids."""
    args = ("--max-model-len", str(max_model_len))
    result, seen, server = run_through_proxy(
        "claude", harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm, args
    )
    log = f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0 and FINAL_TEXT in result.stdout, log
    assert (result.workdir / FILE_NAME).read_text() == FILE_TEXT, log
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    served = served_requests(server.url, upstream_chat)
    assert len(seen.calls) == len(served) >= 2
    per_call = 2 if max_model_len < 128000 else 1
    assert len(upstream_chat) == per_call * len(seen.calls), [
        u["body"].get("max_tokens") for u in upstream_chat
    ]
    assert all(u["body"]["max_tokens"] == 128000 for u in upstream_chat[::per_call])
    for row, asked in zip(seen.calls, served, strict=True):
        assert row["status"] == "completed" and row["trainable"] is True, row["error"]
        assert row["prompt_token_ids"] == asked["answer"]["prompt_token_ids"]
        assert row["output_token_ids"] == asked["answer"]["choices"][0]["token_ids"]
        dropped = [n for n in row["translation_notes"] or [] if "max_tokens=128000 dropped" in n]
        assert len(dropped) == per_call - 1, row["translation_notes"]


@pytest.mark.slow
def test_claude_code_prompt_too_long(
    harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm
):
    """A context smaller than Claude Code's prompt: the server's refusal reaches the harness as
    an Anthropic error and is never resent. vLLM 0.33 checks the cap first: each harness
    request is refused for its max_tokens=128000, resent without it, then refused for the
    prompt — two upstream requests, not three."""
    args = ("--max-model-len", "4096")
    result, seen, server = run_through_proxy(
        "claude", harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm, args
    )
    log = f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode != 0 or FINAL_TEXT not in result.stdout, log
    assert "without any output tokens" in result.stdout + result.stderr, log
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    llm = [e for e in seen.wire if is_llm_request(e)]
    assert llm and len(upstream_chat) == 2 * len(llm) == 2 * len(seen.calls), (
        len(upstream_chat),
        len(llm),
    )
    assert all(e["status"] == 400 for e in llm), [e["status"] for e in llm]
    for row in seen.calls:
        assert row["status"] == "error" and "without any output tokens" in row["error"]
        assert len([n for n in row["translation_notes"] or [] if "max_tokens=128000" in n]) == 1


def test_the_namespace_has_no_way_out_but_the_proxy(netns, make_policy_server):
    """What makes a bypass fail: from inside, neither a public address nor the host's loopback
    services (the policy server) can be reached; only the host end of the veth link can."""
    server = make_policy_server(SCENARIO)
    port = int(server.url.rsplit(":", 1)[1])
    probe = (
        "import socket, sys\n"
        "def dial(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=3).close(); return 'open'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        "print(dial('1.1.1.1', 443), dial('127.0.0.1', int(sys.argv[1])), dial(sys.argv[2], 9))\n"
    )
    r = subprocess.run(
        netns.wrap([sys.executable, "-c", probe, str(port), netns.host_ip]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    public, loopback, host_end = r.stdout.split()
    assert public == "OSError"  # ENETUNREACH: no route
    assert loopback == "ConnectionRefusedError"  # the namespace's own, empty loopback
    assert host_end == "ConnectionRefusedError"  # reachable (a refusal, not a time-out)
