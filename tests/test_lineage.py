"""What a harness says about its calls (trajectory/lineage.py) and the chains that follows from it,
without processes: OpenCode's session headers and its tool-less side calls, parent agents."""

from __future__ import annotations

import json

from mitmproxy.http import Headers

from polar_mitm.trajectory.lineage import agent_of, is_agent, parent_agent, purpose_of
from polar_mitm.trajectory.merge import CallFacts, Merger
from polar_mitm.trajectory.rows import untrainable_reasons

from .test_trajectory import EOT, SYSTEM, USER, body

# As OpenCode 1.18.33 sends them (docs/harness-wire-notes.md).
MAIN = Headers(x_session_affinity="ses_main", x_session_id="ses_main")
SUB = Headers(x_session_affinity="ses_sub", x_session_id="ses_sub", x_parent_session_id="ses_main")
TITLE_BODY = {
    "messages": [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
    ]
}
AGENT_BODY = {
    "messages": [{"role": "system", "content": "You are opencode, an agent"}],
    "tools": [{"type": "function", "function": {"name": "bash"}}],
}


def test_agent_of_reads_opencode_sessions():
    assert agent_of(MAIN) == "ses_main"
    assert agent_of(SUB) == "ses_main/ses_sub"
    # a session id without OpenCode's affinity header names no agent (other harnesses)
    assert agent_of(Headers(x_session_id="s")) is None
    # Codex's own name wins
    codex = Headers(x_codex_turn_metadata=json.dumps({"agent_name": "/root"}), **MAIN)
    assert agent_of(codex) == "/root"


def test_parent_agent_and_is_agent():
    assert parent_agent("/root/worker") == "/root"
    assert parent_agent("/root") is None and parent_agent("ses_a") is None
    assert parent_agent(None) is None
    assert parent_agent("ses_a/ses_b") == "ses_a"
    assert is_agent("ses_a/ses_b", "ses_b") and is_agent("/root", "/root")
    assert not is_agent("ses_a/ses_bb", "ses_b") and not is_agent(None, "x")


def test_purpose_of_opencode_calls():
    assert purpose_of(MAIN, TITLE_BODY) == "title"
    assert purpose_of(MAIN, {"messages": [{"role": "user", "content": "summarize"}]}) == "side"
    assert purpose_of(MAIN, AGENT_BODY) is None  # its agents always send tools: main
    assert purpose_of(Headers(), TITLE_BODY) is None  # not OpenCode: the dialect decides


def test_opencode_title_first_is_a_side_chain_and_the_agent_is_main():
    """The title call comes first; it must not become the main chain, and the agent's own
    conversation must not become a sub-agent of it."""
    m = Merger()
    title = m.add([5, 6, 7], [8, EOT], purpose=purpose_of(MAIN, TITLE_BODY), agent="ses_main")
    first = m.add(SYSTEM + USER, [10, EOT], request_json=json.dumps(AGENT_BODY), agent="ses_main")
    second = m.add(SYSTEM + USER + [10, EOT, 11], [12, EOT], agent="ses_main")
    chains = {c.trace_id: c for c in m.chains}
    assert (chains[title.trace_id].role, chains[title.trace_id].purpose) == ("side", "title")
    assert first.break_reason == "first_call" and chains[first.trace_id].role == "main"
    assert second.attached and second.trace_id == first.trace_id


def test_a_sub_agent_hangs_off_its_parent_session_not_the_longest_prefix():
    """Two sub-agents of one kind share more tokens with each other than with the main chain;
    the second is still the main session's sub-agent, as x-parent-session-id says."""
    m = Merger()
    main_req = body("You are opencode.", [{"role": "user", "content": "go"}])
    main = m.add(SYSTEM + USER, [10, EOT], request_json=main_req, agent="ses_main")
    sub_req = body("You are a general agent.", [{"role": "user", "content": "task one"}])
    a = m.add([1, 2, 3, 4, 40], [41, EOT], request_json=sub_req, agent="ses_main/ses_a")
    b = m.add([1, 2, 3, 4, 50], [51, EOT], request_json=sub_req, agent="ses_main/ses_b")
    assert a.break_reason == b.break_reason == "sub_agent"
    assert a.parent_trace_id == b.parent_trace_id == main.trace_id
    assert b.detail["agent_changed"] is True
    # a sub-agent's own sub-agent: OpenCode names only the direct parent session
    c = m.add([1, 2, 3, 4, 40, 41, EOT, 60], [61, EOT], agent="ses_a/ses_c")
    assert c.parent_trace_id == a.trace_id and c.break_reason == "sub_agent"
    roles = {ch.trace_id: ch.role for ch in m.chains}
    assert [roles[p.trace_id] for p in (a, b, c)] == ["sub", "sub", "sub"]
    # the main session goes on in its own chain
    back = m.add(SYSTEM + USER + [10, EOT, 12], [13, EOT], agent="ses_main")
    assert back.attached and back.trace_id == main.trace_id


def test_a_second_top_level_session_is_not_a_sub_agent():
    m = Merger()
    req = body("You are opencode.", [{"role": "user", "content": "go"}])
    m.add(SYSTEM + USER, [10, EOT], request_json=req, agent="ses_1")
    again = m.add(SYSTEM + USER, [10, EOT], request_json=req, agent="ses_2")
    assert again.break_reason != "sub_agent" and again.detail["agent_changed"] is None


def test_an_anonymous_rollout_is_untrainable_unless_allowed():
    anonymous = CallFacts("c1", rollout_source="client_address")
    named = CallFacts("c2", rollout_source="api_key")
    [reason] = untrainable_reasons([anonymous], [anonymous])
    assert reason.startswith("anonymous: call c1")
    assert untrainable_reasons([anonymous], [anonymous], frozenset({"anonymous"})) == []
    assert untrainable_reasons([named], [named]) == []
    session = CallFacts("c3", rollout_source="session")  # a session header tells sessions apart
    assert untrainable_reasons([session], [session]) == []
