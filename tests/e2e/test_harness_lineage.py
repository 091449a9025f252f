"""The real Qwen Code and OpenCode in exact-prefix mode, and an OpenCode sub-agent: the agent's
own conversation is one main chain, side calls are side chains, a sub-agent's chain hangs off its
parent's.

In chat mode both harnesses hand the "\\n\\n" the server streams between reasoning and a tool call
back as the assistant's content, which the template renders with one more newline than the policy
sampled (test_harnesses.py, assert_rerendered). With `polar_exact_prefix` the proxy sends the
policy its own tokens plus the new messages (docs/exact_prefix.md): what is checked is that the
harness finishes, that every call after the first extends the chain with the server's own ids (each
token-in request asked again gets the same ids), and that the chains are: OpenCode's title call
alone on a `side` chain, the agent's calls on one `main` chain, a `task` sub-agent's calls on one
`sub` chain under it (OpenCode's `x-parent-session-id`).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.helpers.clients import completion_ids

from .harnesses import FILE_NAME, FILE_TEXT, FINAL_TEXT
from .test_harnesses import (
    ROLLOUTS,
    assert_one_main_chain,
    header,
    is_llm_request,
    mask_runs,
)

SCENARIOS = Path(__file__).parent / "scenarios"
OPENCODE_SUBAGENT = SCENARIOS / "opencode_subagent.json"
DELEGATE = "Use a sub-agent (the task tool) to create a file named s.txt containing exactly: sub"
EXACT = {"polar_exact_prefix": "true", "polar_tokenizer": str(qwen3_tokenizer_dir())}


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def assert_token_in_is_exact(seen, server) -> dict[str, dict]:
    """Every call completed with upstream ids; the first call of each chain went the chat way,
    every later one the token-in way extending the call before it in its chain, and the server
    asked again with the same token-in request returns the same ids. The exact-prefix notes by
    call id."""
    rollout = seen.calls[0]["rollout_id"]
    assert all(c["rollout_id"] == rollout for c in seen.calls)
    notes = {}
    for row in seen.calls:
        assert row["status"] == "completed" and row["ids_source"] == "upstream", row["error"]
        assert row["trainable"] is True
        notes[row["call_id"]] = json.loads(row["fidelity_json"] or "{}").get("exact_prefix", {})
    token_in = [u for u in seen.upstream if u["path"] == "/v1/completions"]
    by_prompt = {json.dumps(u["body"]["prompt"]): u["body"] for u in token_in}
    rows = {c["call_id"]: c for c in seen.calls}
    for row in seen.calls:
        note = notes[row["call_id"]]
        if row["route"] != "token_in":
            continue
        before = rows[note["extends_call"]]
        chain = before["prompt_token_ids"] + before["output_token_ids"]
        assert row["prompt_token_ids"][: len(chain)] == chain  # the policy's own tokens
        body = by_prompt[json.dumps(row["prompt_token_ids"])]
        again = httpx.post(
            server.url + "/v1/completions",
            json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
            timeout=60,
        ).json()
        assert row["output_token_ids"] == completion_ids(again["choices"][0])
    return notes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "opencode"])
def test_exact_prefix_keeps_the_conversation_on_one_main_chain(name, harness_session, qwen3):
    result, seen, server, log = harness_session(name, mitm_options=EXACT)
    assert FINAL_TEXT in result.stdout, log
    assert (result.workdir / FILE_NAME).read_text() == FILE_TEXT, log
    llm = [e for e in seen.wire if is_llm_request(e)]
    assert len(llm) == len(seen.calls) and all(e["status"] == 200 for e in llm)
    assert_token_in_is_exact(seen, server)
    main_calls = [c for c in seen.calls if c["purpose"] == "main"]
    assert [c["route"] for c in main_calls] == ["chat", "token_in"]
    mains = [t for t in seen.traces if t["role"] == "main"]
    assert len(mains) == 1, [(t["role"], t["break_reason"]) for t in seen.traces]
    assert_one_main_chain(mains[0], main_calls, qwen3)
    side = [c for c in seen.calls if c["purpose"] != "main"]
    if name == "opencode":  # its title call, on a side chain of its own
        # opencode sends the title call beside the first main call, so either may
        # reach the proxy first: the title is found by what it asks, not by order.
        assert [c["purpose"] for c in side] == ["title"]
        [title] = [t for t in seen.traces if t["role"] == "side"]
        assert (title["call_ids"], title["break_reason"]) == ([side[0]["call_id"]], "side_call")
        [asked] = [e for e in llm if "tools" not in e["body"]]
        assert "title generator" in asked["body"]["messages"][0]["content"]
    else:  # Qwen Code made no side call
        assert side == [] and len(seen.traces) == 1
    assert ROLLOUTS[name][0] == mains[0]["rollout_id"]


@pytest.mark.slow
def test_an_opencode_task_sub_agent_is_a_linked_sub_chain(harness_session, qwen3):
    result, seen, server, log = harness_session(
        "opencode", mitm_options=EXACT, scenario=OPENCODE_SUBAGENT, prompt=DELEGATE
    )
    assert "The sub-agent created s.txt." in result.stdout, log
    assert (result.workdir / "s.txt").read_text() == "sub", log
    assert_token_in_is_exact(seen, server)

    # What OpenCode said about each call: the sub-agent's session names its parent.
    llm = [e for e in seen.wire if is_llm_request(e)]
    sessions = [(header(e, "x-session-id"), header(e, "x-parent-session-id")) for e in llm]
    main_session = sessions[0][0]
    subs = {s for s, parent in sessions if parent == main_session}
    assert len(subs) == 1, sessions
    [sub_session] = subs
    assert {s for s, _ in sessions} == {main_session, sub_session}
    sub_agent = f"{main_session}/{sub_session}"
    assert [c["agent"] for c in seen.calls] == [
        sub_agent if parent else session for session, parent in sessions
    ]

    by_call = {cid: t for t in seen.traces for cid in t["call_ids"]}
    main_calls = [c for c in seen.calls if c["agent"] == main_session and c["purpose"] == "main"]
    sub_calls = [c for c in seen.calls if c["agent"] == sub_agent and c["purpose"] == "main"]
    assert len(main_calls) == 2 and len(sub_calls) == 2, [
        (c["agent"], c["purpose"]) for c in seen.calls
    ]
    main = by_call[main_calls[0]["call_id"]]
    sub = by_call[sub_calls[0]["call_id"]]
    # The agent's own conversation: one main chain, the task's result between its two turns.
    assert (main["role"], main["break_reason"], main["agent"]) == (
        "main",
        "first_call",
        main_session,
    )
    assert main["call_ids"] == [c["call_id"] for c in main_calls]
    # The sub-agent: one sub chain, hung off the main chain (not the title's side chain).
    assert (sub["role"], sub["break_reason"], sub["agent"]) == ("sub", "sub_agent", sub_agent)
    assert sub["call_ids"] == [c["call_id"] for c in sub_calls]
    assert sub["parent_trace_id"] == main["trace_id"]
    assert json.loads(sub["break_detail"])["agent_changed"] is True
    assert [v for v, _, _ in mask_runs(sub["loss_mask"])] == [0, 1, 0, 1]
    assert "SUBTASK" in qwen3.decode(sub_calls[0]["prompt_token_ids"])
    # Side calls (titles of both sessions) are side chains, in no agent chain.
    for c in seen.calls:
        if c["purpose"] != "main":
            t = by_call[c["call_id"]]
            assert (t["role"], t["call_ids"]) == ("side", [c["call_id"]]), t
    assert all(t["trainable"] for t in seen.traces), [t["untrainable_reason"] for t in seen.traces]
