"""Long sessions with the real harnesses: compaction and sub-agents, and the chains across them.

Codex 0.169 is run with `model_auto_compact_token_limit` below its first prompt, so it compacts
after every model turn of a three-tool-call task (write a.txt, b.txt, c.txt): each compaction
request (`compaction_trigger` last) is answered by the policy through polar-mitm with one
`compaction` item, and Codex goes on from it. The scenario (scenarios/codex_compaction.json)
tells the steps apart by the progress its summaries record, since the history that would tell
them is gone after each compaction. What is checked: Codex exits 0 with the files written;
every call is `completed` with exactly the server's ids; each compaction call has purpose
`compaction` and its own `side` chain branching off the chain it summarizes; the main chain
after it starts with break reason `compaction` and that chain as its parent. Claude Code 2.1.328
is made to compact by itself once (its window and threshold variables, a large tool output; see
CLAUDE_COMPACT_ENV), with the same checks on its summary call and the chain after it. A Codex `spawn_agent` sub-agent
and a Claude Code `Agent` sub-agent each become one `sub` chain under the chain that spawned it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from polar_mitm.dialects import compaction

from .harnesses import HARNESSES, Harness
from .test_harnesses import ROLLOUTS, assert_exact_calls, header, is_llm_request

SCENARIOS = Path(__file__).parent / "scenarios"
CODEX_COMPACTION = SCENARIOS / "codex_compaction.json"
THREE_FILES = (
    "Create three files, a.txt, b.txt and c.txt, each containing exactly its own name without "
    "the extension (a, b, c); use one shell command per file."
)
THREE_DONE = "I created a.txt, b.txt and c.txt."
# Below Codex's first prompt (its instructions alone are several thousand tokens): it compacts
# after every model turn that asks for a tool.
COMPACT_LIMIT = 2000


def codex_configured(config: str) -> Harness:
    """Codex with `config` as its ~/.codex/config.toml."""

    def configure(home: Path, work: Path, bin_dir: Path) -> None:
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(config)

    return dataclasses.replace(HARNESSES["codex"], configure=configure)


def items_of(entry: dict) -> list[dict]:
    return [i for i in entry["body"].get("input") or [] if isinstance(i, dict)]


def test_the_scenario_knows_the_compaction_instruction():
    """The scenario picks compaction requests by a phrase of the instruction: keep them in step."""
    scripts = json.loads(CODEX_COMPACTION.read_text())["scripts"]
    marks = {s["match"].get("last_user_contains") for s in scripts if "match" in s} - {None}
    assert marks and all(m in compaction.INSTRUCTION for m in marks)


def assert_compaction_links(seen, i: int) -> None:
    """Call `i` is a compaction: its own `side` chain (purpose `compaction`) off the chain it
    summarizes (the one holding call i-1), whose tokens are policy tokens; call i+1 starts a
    `main` chain with break reason `compaction` and that same chain as its parent."""
    calls = seen.calls
    by_call = {cid: t for t in seen.traces for cid in t["call_ids"]}
    before, summary, after = calls[i - 1], calls[i], calls[i + 1]
    parent = by_call[before["call_id"]]
    own = by_call[summary["call_id"]]
    assert (own["role"], own["purpose"], own["call_ids"]) == (
        "side",
        "compaction",
        [summary["call_id"]],
    )
    assert own["parent_trace_id"] == parent["trace_id"]
    assert own["num_policy_tokens"] == len(summary["output_token_ids"]) > 0
    nxt = by_call[after["call_id"]]
    assert nxt["call_ids"][0] == after["call_id"], "the call after a compaction starts a chain"
    assert (nxt["role"], nxt["break_reason"]) == ("main", "compaction"), nxt["break_detail"]
    assert nxt["parent_trace_id"] == parent["trace_id"]


@pytest.mark.slow
def test_codex_survives_compaction_with_the_policy_writing_the_summary(harness_session):
    rollout, source = ROLLOUTS["codex"]
    harness = codex_configured(f"model_auto_compact_token_limit = {COMPACT_LIMIT}\n")
    result, seen, server, log = harness_session(
        scenario=CODEX_COMPACTION, harness=harness, prompt=THREE_FILES
    )
    assert THREE_DONE in result.stdout, log
    for name in "abc":
        assert (result.workdir / f"{name}.txt").read_text() == name, log

    llm = [e for e in seen.wire if is_llm_request(e)]
    assert all(e["status"] == 200 for e in llm), [(e["path"], e["status"]) for e in llm]
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    assert_exact_calls(seen, server, llm, upstream_chat, rollout, source)

    # What Codex sent: compaction requests end with the trigger; the request after each one
    # carries the compaction item it was answered, in place of the history.
    triggered = [
        i
        for i, e in enumerate(llm)
        if items_of(e) and items_of(e)[-1].get("type") == "compaction_trigger"
    ]
    assert len(triggered) >= 1, [[i.get("type") for i in items_of(e)] for e in llm]
    for i in triggered:
        metadata = json.loads(header(llm[i], "x-codex-turn-metadata") or "{}")
        assert metadata.get("request_kind") == "compaction", metadata
        assert "remote_compaction_v2" in (header(llm[i], "x-codex-beta-features") or "")
        after = llm[i + 1]
        assert any(compaction.is_summary_item(x) for x in items_of(after)), items_of(after)

    calls = seen.calls
    purposes = [c["purpose"] for c in calls]
    assert [i for i, p in enumerate(purposes) if p == "compaction"] == triggered, purposes
    assert set(purposes) <= {"main", "compaction"}, purposes
    for i in triggered:
        assert_compaction_links(seen, i)
    assert all(t["trainable"] for t in seen.traces), [t["untrainable_reason"] for t in seen.traces]


CODEX_SUBAGENT = SCENARIOS / "codex_subagent.json"
DELEGATE = "Use a sub-agent (spawn_agent) to create a file named s.txt containing exactly: sub"


@pytest.mark.slow
def test_a_codex_spawn_agent_sub_agent_is_a_linked_sub_chain(harness_session):
    rollout, source = ROLLOUTS["codex"]
    result, seen, server, log = harness_session(scenario=CODEX_SUBAGENT, prompt=DELEGATE)
    assert "The sub-agent created s.txt." in result.stdout, log
    assert (result.workdir / "s.txt").read_text() == "sub", log

    llm = [e for e in seen.wire if is_llm_request(e)]
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    assert_exact_calls(seen, server, llm, upstream_chat, rollout, source)
    agents = [json.loads(header(e, "x-codex-turn-metadata") or "{}").get("agent_name") for e in llm]
    assert [c["agent"] for c in seen.calls] == agents
    spawned = sorted({a for a in agents if a != "/root"})
    assert len(spawned) == 1 and spawned[0].startswith("/root/"), agents

    by_call = {cid: t for t in seen.traces for cid in t["call_ids"]}
    root_calls = [c for c in seen.calls if c["agent"] == "/root"]
    sub_calls = [c for c in seen.calls if c["agent"] == spawned[0]]
    # The sub-agent's calls are one sub chain, hung off the root chain that spawned it.
    root = by_call[root_calls[0]["call_id"]]
    sub = by_call[sub_calls[0]["call_id"]]
    assert sub["call_ids"] == [c["call_id"] for c in sub_calls]
    assert (sub["role"], sub["break_reason"], sub["agent"]) == ("sub", "sub_agent", spawned[0])
    assert sub["parent_trace_id"] == root["trace_id"] and root["role"] == "main"
    assert json.loads(sub["break_detail"])["agent_changed"] is True
    # The root's calls stay in root chains. Its answer from the sub-agent is a new user turn
    # (an `agent_message`), before which Qwen3's template drops earlier thinking: the root's
    # last call re-renders its history and starts a main chain of its own (`rerender`).
    for c in root_calls:
        t = by_call[c["call_id"]]
        assert (t["role"], t["agent"]) == ("main", "/root"), t
        if t is not root:
            assert t["break_reason"] == "rerender" and t["parent_trace_id"] == root["trace_id"]
    assert all(t["trainable"] for t in seen.traces), [t["untrainable_reason"] for t in seen.traces]


CLAUDE_COMPACTION = SCENARIOS / "claude_compaction.json"
LIST_AND_WRITE = (
    "List the numbers 1 to 3000 with seq, then create a.txt and b.txt, each containing exactly "
    "its own name without the extension; one Bash command each."
)
LIST_DONE = "I listed the numbers and created a.txt and b.txt."
# What makes Claude Code 2.1.328 compact (its bundle, docs/trajectories.md "Lineage"): a window
# set by CLAUDE_CODE_AUTO_COMPACT_WINDOW (below 100k it counts as 100k; without one it does not
# compact before a call), 100k - 20k of output room = 80k, and CLAUDE_AUTOCOMPACT_PCT_OVERRIDE of that:
# 26.25% = 21,000 tokens, compared with the last reply's usage (the Qwen3 prompt the proxy
# reports, 11.5k for Claude Code's first prompt) plus its own estimate of what came after. The
# ~14k Qwen3 tokens of `seq 1 3000` (each digit is a token) put the third call's check over
# it, and only that one: before the second call Claude Code counts that output by its own
# estimate (from bytes, far below 14k), and after the compaction the prompt is back near 11.7k.
CLAUDE_COMPACT_ENV = {
    "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000",
    "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "26.25",
}


def first_user_text(entry: dict) -> str:
    first = next(m for m in entry["body"]["messages"] if m["role"] == "user")
    content = first["content"]
    return content if isinstance(content, str) else content[0].get("text", "")


@pytest.mark.slow
def test_claude_code_compacts_by_itself_and_the_chains_stay_linked(harness_session):
    rollout, source = ROLLOUTS["claude"]
    claude = HARNESSES["claude"]
    harness = dataclasses.replace(claude, extra_env={**claude.extra_env, **CLAUDE_COMPACT_ENV})
    result, seen, server, log = harness_session(
        "claude", scenario=CLAUDE_COMPACTION, harness=harness, prompt=LIST_AND_WRITE
    )
    assert LIST_DONE in result.stdout, log
    for name in "ab":
        assert (result.workdir / f"{name}.txt").read_text() == name, log

    llm = [e for e in seen.wire if is_llm_request(e)]
    assert all(e["status"] == 200 for e in llm), [(e["path"], e["status"]) for e in llm]
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    assert_exact_calls(seen, server, llm, upstream_chat, rollout, source)

    # What Claude Code sent: one summary request (its own prompt, last), then a conversation
    # whose first user turn is the continuation message with the policy's summary.
    asked = [
        i
        for i, e in enumerate(llm)
        if compaction.CLAUDE_COMPACT_PROMPT in json.dumps(e["body"]["messages"][-1])
    ]
    assert len(asked) == 1 and 0 < asked[0] < len(llm) - 1, len(llm)
    (i,) = asked
    after = first_user_text(llm[i + 1])
    assert after.startswith(compaction.CLAUDE_CONTINUATION) and "[progress 1]" in after, after

    purposes = [c["purpose"] for c in seen.calls]
    assert [n for n, p in enumerate(purposes) if p == "compaction"] == asked, purposes
    assert_compaction_links(seen, i)
    assert all(t["trainable"] for t in seen.traces), [t["untrainable_reason"] for t in seen.traces]


CLAUDE_SUBAGENT = SCENARIOS / "claude_subagent.json"
CLAUDE_DELEGATE = (
    "Use a sub-agent (the Agent tool) to create a file named s.txt containing exactly: sub"
)


@pytest.mark.slow
def test_a_claude_code_agent_sub_agent_is_a_linked_sub_chain(harness_session):
    rollout, source = ROLLOUTS["claude"]
    result, seen, server, log = harness_session(
        "claude", scenario=CLAUDE_SUBAGENT, prompt=CLAUDE_DELEGATE
    )
    assert "The sub-agent created s.txt." in result.stdout, log
    assert (result.workdir / "s.txt").read_text() == "sub", log

    llm = [e for e in seen.wire if is_llm_request(e)]
    upstream_chat = [u for u in seen.upstream if u["path"] == "/v1/chat/completions"]
    assert_exact_calls(seen, server, llm, upstream_chat, rollout, source)
    # Claude Code says which agent sent each request (another system prompt and tool set tell
    # the proxy, which does not read this header).
    kinds = [header(e, "x-claude-code-request-class") for e in llm]
    main_calls = [c for c, k in zip(seen.calls, kinds, strict=True) if k == "main"]
    sub_calls = [c for c, k in zip(seen.calls, kinds, strict=True) if k == "subagent"]
    assert len(main_calls) == 2 and len(sub_calls) == 2, kinds

    by_call = {cid: t for t in seen.traces for cid in t["call_ids"]}
    main = by_call[main_calls[0]["call_id"]]
    sub = by_call[sub_calls[0]["call_id"]]
    # The parent's calls around the Agent tool stay one main chain (the sub-agent's answer is
    # the Agent tool's result); the sub-agent's calls are one sub chain hung off it.
    assert (main["role"], main["call_ids"]) == ("main", [c["call_id"] for c in main_calls])
    assert (sub["role"], sub["break_reason"]) == ("sub", "sub_agent"), sub["break_detail"]
    assert sub["call_ids"] == [c["call_id"] for c in sub_calls]
    assert sub["parent_trace_id"] == main["trace_id"]
    assert json.loads(sub["break_detail"])["system_changed"] is True
    assert all(t["trainable"] for t in seen.traces), [t["untrainable_reason"] for t in seen.traces]
