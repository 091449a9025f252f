"""Compaction and sub-agent lineage, without processes: the Responses compaction protocol as the
dialect answers it, and the chains the merge makes of it (the real binaries: tests/e2e)."""

from __future__ import annotations

import json

import pytest

from polar_mitm.core.sse import SSEParser
from polar_mitm.dialects import DialectError, by_name, compaction, detect
from polar_mitm.dialects.assemble import reply_to_chunks
from polar_mitm.trajectory.lineage import agent_of
from polar_mitm.trajectory.merge import Merger

RESPONSES = by_name("openai_responses")
EOT = 99


def chat_reply(text: str, reasoning: str | None = None, tool: bool = False) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning"] = reasoning
    if tool:
        message["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": "exec", "arguments": "{}"}}
        ]
    return {
        "id": "chat-1",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47},
    }


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


HISTORY = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
    user("write three files"),
    {"type": "custom_tool_call", "call_id": "c1", "name": "exec", "input": "ls"},
    {"type": "custom_tool_call_output", "call_id": "c1", "output": "a.txt"},
]


def parse(items: list, path: str = "/v1/responses", stream: bool = True):
    body = {"model": "gpt-5", "stream": stream, "input": items}
    body["include"] = ["reasoning.encrypted_content"]
    return RESPONSES.parse(json.dumps(body).encode(), path)


def events(raw: bytes) -> list[dict]:
    parser = SSEParser()
    return [json.loads(e.data) for e in parser.feed(raw)]


def test_a_compaction_trigger_asks_the_policy_for_a_summary_and_answers_one_item():
    req = parse([*HISTORY, {"type": "compaction_trigger"}])
    assert req.purpose == "compaction"
    assert req.chat["messages"][-1] == {"role": "user", "content": compaction.INSTRUCTION}
    translator = RESPONSES.stream(req)
    chunks = reply_to_chunks(chat_reply("Made a.txt; next b.txt.", "thinking", tool=True))
    out = b"".join(translator.chunk(c) for c in chunks) + translator.finish()
    seen = events(out)
    kinds = [e["type"] for e in seen]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
        "response.completed",
    ]
    done = seen[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["compaction"]  # no reasoning, no tool call
    item = done["output"][0]
    assert item["id"] == seen[2]["item"]["id"] and item["encrypted_content"].startswith("polar1:")
    assert done["usage"]["output_tokens"] == 7

    # The item comes back in place of the history: the policy reads the summary it wrote.
    later = parse([HISTORY[0], HISTORY[1], item, user("go on")])
    assert later.purpose == "main"
    assert later.chat["messages"][2] == {
        "role": "user",
        "content": compaction.SUMMARY_PREFIX + "Made a.txt; next b.txt.",
    }


def test_the_compact_endpoint_answers_a_compaction_object_keeping_the_user_messages():
    assert detect("POST", "/v1/responses/compact") is RESPONSES
    req = parse(HISTORY, "/v1/responses/compact", stream=False)
    assert req.purpose == "compaction" and req.stream is False
    reply = RESPONSES.reply(req, chat_reply("summary"))
    assert reply["object"] == "response.compaction"
    assert [(i["type"], i.get("role")) for i in reply["output"]] == [
        ("message", "user"),
        ("compaction", None),
    ]
    assert reply["output"][0]["content"] == HISTORY[1]["content"]
    text = parse([reply["output"][1]]).chat["messages"][0]["content"]
    assert text == compaction.SUMMARY_PREFIX + "summary"


def test_bad_compaction_input_is_a_clear_400():
    with pytest.raises(DialectError, match="compaction_trigger must be the last item"):
        parse([{"type": "compaction_trigger"}, *HISTORY])
    openai_item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "gAAAAB..."}
    with pytest.raises(DialectError, match=r"input\[1\].*did not write"):
        parse([user("hi"), openai_item])


def test_claude_codes_own_compaction_call_has_purpose_compaction():
    messages = by_name("anthropic_messages")
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1000,
        "system": "You are Claude Code, Anthropic's official CLI for Claude.",
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [{"type": "text", "text": compaction.CLAUDE_COMPACT_PROMPT}],
            },
        ],
    }
    assert messages.parse(json.dumps(body).encode(), "/v1/messages").purpose == "compaction"
    body["messages"] = body["messages"][:1]
    assert messages.parse(json.dumps(body).encode(), "/v1/messages").purpose == "main"


def responses_body(items: list) -> str:
    return json.dumps({"model": "gpt-5", "instructions": "S", "input": items})


SYSTEM = list(range(1000, 1400))


def test_a_compaction_item_gives_the_next_chain_the_compaction_lineage():
    """One message dropped and one added is an edit by history alone (break `other`); the
    compaction item is what says it was compacted."""
    m = Merger()
    before = [user("task"), {"type": "message", "role": "assistant", "content": "step 1"}]
    main = m.add(SYSTEM + [1, 2], [3, EOT], request_json=responses_body(before))
    trigger = [*before, {"type": "compaction_trigger"}]
    cmp_call = m.add(
        SYSTEM + [1, 2, 3, EOT, 50],
        [51, EOT],
        purpose="compaction",
        request_json=responses_body(trigger),
    )
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "polar1:eA=="}
    after = m.add(SYSTEM + [1, 60], [61, EOT], request_json=responses_body([user("task"), item]))
    chains = {c.trace_id: c for c in m.chains}
    assert (chains[cmp_call.trace_id].role, chains[cmp_call.trace_id].purpose) == (
        "side",
        "compaction",
    )
    assert cmp_call.parent_trace_id == main.trace_id
    assert after.break_reason == "compaction" and after.parent_trace_id == main.trace_id
    assert after.detail["compacted"] is True and after.detail["history"] == "edited"
    assert chains[after.trace_id].role == "main"


def test_a_codex_sub_agent_is_a_sub_chain_even_when_its_prompt_extends_the_parent():
    m = Merger()
    req = responses_body([user("task")])
    root = m.add(SYSTEM + [1], [2, EOT], request_json=req, agent="/root")
    # spawn_agent with the parent's history forked: the prompt extends the root chain
    sub = m.add(SYSTEM + [1, 2, EOT, 70], [71, EOT], request_json=req, agent="/root/worker")
    assert not sub.attached and sub.break_reason == "sub_agent"
    assert sub.parent_trace_id == root.trace_id and sub.detail["agent_changed"] is True
    chains = {c.trace_id: c for c in m.chains}
    assert (chains[sub.trace_id].role, chains[sub.trace_id].agent) == ("sub", "/root/worker")
    # each agent's next call extends its own chain
    nxt = m.add(SYSTEM + [1, 2, EOT, 70, 71, EOT, 72], [73, EOT], agent="/root/worker")
    assert nxt.trace_id == sub.trace_id and nxt.attached
    back = m.add(SYSTEM + [1, 2, EOT, 80], [81, EOT], agent="/root")
    assert back.trace_id == root.trace_id and back.attached


def test_agent_of_reads_codex_turn_metadata():
    assert agent_of({"x-codex-turn-metadata": json.dumps({"agent_name": "/root"})}) == "/root"
    assert agent_of({"x-codex-turn-metadata": "not json"}) is None
    assert agent_of({}) is None


def test_a_codex_agent_message_is_a_user_turn_with_its_payload():
    """As Codex 0.169 sends a spawn_agent task (recorded): a header part, then the `message`
    argument the policy wrote, in an `encrypted_content` part."""
    item = {
        "type": "agent_message",
        "author": "/root",
        "recipient": "/root/writer",
        "content": [
            {"type": "input_text", "text": "Message Type: NEW_TASK\nPayload:\n"},
            {"type": "encrypted_content", "encrypted_content": "SUBTASK: write s.txt"},
        ],
    }
    req = parse([user("hi"), item])
    assert req.chat["messages"][1] == {
        "role": "user",
        "content": "Message Type: NEW_TASK\nPayload:\nSUBTASK: write s.txt",
    }


def test_the_chain_tree_is_depth_first_under_each_parent():
    from polar_mitm.cli.chaintree import label, tree_lines

    rows = [
        {"trace_id": "m1", "role": "main", "break_reason": "first_call", "call_ids": ["a"]},
        {"trace_id": "c1", "parent_trace_id": "m1", "role": "side", "purpose": "compaction"},
        {"trace_id": "m2", "parent_trace_id": "m1", "role": "main", "break_reason": "compaction"},
        {"trace_id": "s1", "parent_trace_id": "m2", "role": "sub", "agent": "/root/w"},
        {"trace_id": "orphan", "parent_trace_id": "gone", "role": "side"},
    ]
    lines = tree_lines(rows)
    assert [(x["depth"], x["trace_id"]) for x in lines] == [
        (0, "m1"),
        (1, "c1"),
        (1, "m2"),
        (2, "s1"),
        (0, "orphan"),
    ]
    assert "purpose compaction" in label(rows[1]) and "agent /root/w" in label(rows[3])
