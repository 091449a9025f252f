"""The official SDKs' tool loops through real mitmdump + addon to the real vLLM: chat
completions, Responses and Messages, streamed and not. Each conversation is one chain whose ids
are the engine's own and whose logprobs the engine's re-scoring confirms (checks.py)."""

from __future__ import annotations

import pytest

from polar_mitm.store import read_table
from tests.e2e.loopback.test_capture_e2e import calls_of
from tests.e2e.loopback.test_dialects_e2e import (
    FINAL_TEXT,
    QUESTION,
    SYSTEM,
    anthropic_client,
    messages_loop,
    responses_loop,
)
from tests.helpers.clients import RUN_SHELL, _streamed_reply, openai_client, tool_messages

from .checks import check_exact, check_rescoring

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


def chat_loop(client, stream: bool) -> list[dict]:
    """A careful chat harness: each reply goes back with its reasoning (an OpenAI SDK that drops
    it breaks the chain at the template's re-render: tests/e2e/loopback/test_fidelity_e2e.py)."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    replies = []
    for _ in range(3):
        if stream:
            reply = _streamed_reply(client, messages, "gpt-4.1")
        else:
            c = client.chat.completions.create(
                model="gpt-4.1", messages=messages, tools=[RUN_SHELL]
            )
            reply = c.choices[0].message.model_dump(exclude_none=True)
        replies.append(reply)
        # the text trimmed, as Pi does: vLLM's parsers hand back the template's "\n\n" and the
        # "\n" before <tool_call> as content, which the template would render once more
        turn = {k: reply[k] for k in ("reasoning", "tool_calls") if reply.get(k)}
        messages.append(
            {"role": "assistant", "content": (reply.get("content") or "").strip() or None, **turn}
        )
        messages += tool_messages(reply)
        if not reply.get("tool_calls"):
            break
    return replies


def one_chain(mitm, rows: list[dict], vllm_url: str, rollout: str) -> dict:
    """The rollout's calls merged into one trainable main trace, re-scored by the engine."""
    traces = read_table(str(mitm.output), "traces").to_pylist()
    mains = [t for t in traces if t["rollout_id"] == rollout]
    assert len(mains) == 1, [(t["role"], t["break_reason"]) for t in traces]
    [trace] = mains
    assert trace["call_ids"] == [r["call_id"] for r in rows]
    assert trace["trainable"] is True, trace["untrainable_reason"]
    last = rows[-1]
    assert trace["input_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
    scored = check_rescoring(vllm_url, trace)
    assert scored.constrained_tokens == 0  # no grammar in these requests
    return trace


@STREAM
def test_chat_loop(vllm, recorder, make_mitm, stream):
    mitm = make_mitm(recorder.url)
    client = openai_client(mitm, api_key="polar-vchat.0")
    replies = chat_loop(client, stream)
    assert replies[-1]["content"].strip() == FINAL_TEXT
    assert [bool(r.get("tool_calls")) for r in replies] == [True, True, False]
    rows = calls_of(mitm)
    assert len(rows) == 3 and all(r["trainable"] for r in rows)
    check_exact(rows, recorder)
    one_chain(mitm, rows, vllm.url, "vchat.0")


@STREAM
def test_responses_loop(vllm, recorder, make_mitm, stream):
    mitm = make_mitm(recorder.url)
    finals = responses_loop(openai_client(mitm, api_key="polar-vresp.0"), stream)
    assert [[i.type for i in f.output] for f in finals] == [
        ["reasoning", "function_call"],
        ["reasoning", "message", "function_call"],
        ["reasoning", "message"],
    ]
    assert finals[-1].output_text.strip() == FINAL_TEXT
    rows = calls_of(mitm)
    check_exact(rows, recorder)
    for final, row in zip(finals, rows, strict=True):
        assert final.usage.input_tokens == len(row["prompt_token_ids"])
        assert final.usage.output_tokens == len(row["output_token_ids"])
    one_chain(mitm, rows, vllm.url, "vresp.0")


@STREAM
def test_messages_loop(vllm, recorder, make_mitm, stream):
    mitm = make_mitm(recorder.url)
    finals = messages_loop(anthropic_client(mitm, api_key="polar-vmsg.0"), stream)
    assert [f.stop_reason for f in finals] == ["tool_use", "tool_use", "end_turn"]
    assert finals[-1].content[-1].text.strip() == FINAL_TEXT
    rows = calls_of(mitm)
    check_exact(rows, recorder)
    one_chain(mitm, rows, vllm.url, "vmsg.0")
