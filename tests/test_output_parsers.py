"""Exact-prefix mode's output parsing: raw token-in text -> the chat endpoint's reply.

The sampled ids are the real Qwen3 tokenization of an assistant turn with reasoning, text and two
tool calls (the reference server's own rendering). Streamed in chunks split at every possible
token boundary — and one token per chunk, and in irregular groups — the assembled reply is the
same every time, and agrees with the non-streaming parse of the whole text.
"""

from __future__ import annotations

import json
import random
from array import array

import pytest
from polar_reference.render import Renderer, RenderInput
from polar_reference.scenario import ToolCallSpec, Turn

from polar_mitm.call.token_in import TokenInReply
from polar_mitm.dialects.assemble import ChatAssembler
from polar_mitm.output_parsers import FAMILIES, family
from polar_mitm.output_parsers.hermes_stream import is_complete_json
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.trajectory.exact_prefix import ExactPlan
from polar_mitm.upstream import UPSTREAMS, TokenTally

TURN = Turn(
    reasoning="Two commands: list, then count. Ünïcödé ✓ stays whole.",
    content="Running both now.",
    tool_calls=(
        ToolCallSpec("run_shell", {"cmd": "ls -la", "timeout": 5}),
        ToolCallSpec("run_shell", {"cmd": "wc -l notes.txt", "env": {"LANG": "C"}}),
    ),
)


@pytest.fixture(scope="module")
def sampled():
    renderer = Renderer()
    inp = RenderInput(messages=[{"role": "user", "content": "go"}], tools=None, kwargs={})
    completion = renderer.completion(inp, TURN)
    tok = load_tokenizer(str(renderer.tokenizer_dir))
    return list(completion.ids), list(completion.pieces), tok


def _plan(parse_tools: bool = True) -> ExactPlan:
    return ExactPlan(
        array("i", [1, 2, 3]), b"[1,2,3]", 0, "c", {"max_tokens": 100}, parse_tools, True, None
    )


def _reply(tok, kind: str = "vllm", wants_logprobs: bool = False) -> TokenInReply:
    upstream = UPSTREAMS[kind]("http://127.0.0.1:9")
    return TokenInReply(
        upstream,
        _plan(),
        family=family("qwen3"),
        tokenizer=tok,
        tally=TokenTally(),
        model="m",
        wants_logprobs=wants_logprobs,
    )


def _chunk(text: str, ids: list[int], finish: str | None) -> dict:
    """vLLM's token-in chunk: the sampled ids as `return_tokens_as_token_ids` names them."""
    logprobs = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}


def _stream(tok, ids, pieces, cuts: list[int]) -> tuple[dict, TokenInReply]:
    reply = _reply(tok)
    assembler = ChatAssembler()
    bounds = [0, *cuts, len(ids)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        finish = "stop" if b == len(ids) else None
        for chunk in reply.chunks(_chunk("".join(pieces[a:b]), ids[a:b], finish)):
            assembler.feed(chunk)
    return assembler.as_reply()["choices"][0] | {"message": assembler.message()}, reply


def _seen(message: dict) -> tuple:
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    ]
    return (message.get("reasoning"), (message.get("content") or "").strip(), calls)


def test_every_chunk_boundary_parses_the_same(sampled):
    ids, pieces, tok = sampled
    whole = _reply(tok).reply(_chunk("".join(pieces), ids, "stop"))
    expected = _seen(whole["choices"][0]["message"])
    assert expected[0].strip() == TURN.reasoning
    assert expected[1] == TURN.content
    assert expected[2] == [(c.name, c.arguments) for c in TURN.tool_calls]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"

    splits = [[k] for k in range(1, len(ids))]  # two chunks, cut at every token boundary
    splits.append(list(range(1, len(ids))))  # one token per chunk
    rng = random.Random(7)
    for _ in range(20):  # irregular groups
        splits.append(sorted(rng.sample(range(1, len(ids)), rng.randint(2, 12))))
    results = set()
    for cuts in splits:
        choice, reply = _stream(tok, ids, pieces, cuts)
        assert choice["finish_reason"] == "tool_calls", cuts
        assert reply.tally.output_ids == ids
        results.add(json.dumps(_seen(choice["message"])))
    assert results == {json.dumps(expected)}


def test_tool_call_ids_and_order_are_stable_and_the_tally_keeps_the_finish(sampled):
    ids, pieces, tok = sampled
    choice, reply = _stream(tok, ids, pieces, [3, 17, 40])
    calls = choice["message"]["tool_calls"]
    assert [c["id"].startswith("chatcmpl-tool-") for c in calls] == [True, True]
    assert len({c["id"] for c in calls}) == 2
    assert reply.tally.finish_reason == "tool_calls"


def test_text_only_and_cut_off_replies(sampled):
    _, _, tok = sampled
    reply = _reply(tok)
    text = "<think>\nshort\n</think>\n\nJust text."
    ids = tok.encode(text)
    out = reply.reply(_chunk(text, ids, "length"))
    message = out["choices"][0]["message"]
    # vLLM's qwen3 parser keeps the text after </think> as it is
    assert message["content"] == "\n\nJust text." and message["reasoning"] == "\nshort\n"
    assert out["choices"][0]["finish_reason"] == "length"  # cut off: never tool_calls


def test_sglang_generate_reply_is_parsed_the_same(sampled):
    ids, pieces, tok = sampled
    raw = {
        "text": "".join(pieces),
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": 3,
            "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.5, i, None] for i in ids],
        },
    }
    reply = _reply(tok, "sglang")
    out = reply.reply(raw)
    assert _seen(out["choices"][0]["message"])[2] == [
        (c.name, c.arguments) for c in TURN.tool_calls
    ]
    assert reply.tally.output_ids == ids and reply.tally.logprobs == [-0.5] * len(ids)
    assert reply.tally.usage == {
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "total_tokens": 3 + len(ids),
    }


def test_families_are_registered_and_unknown_names_are_refused():
    assert set(FAMILIES) == {"qwen3", "hermes"}
    with pytest.raises(ValueError, match="unknown output parser 'llama'"):
        family("llama")


def test_a_token_in_reply_names_its_tokens_by_id(sampled):
    """vLLM's token-in reply carries the sampled ids only as `return_tokens_as_token_ids`'s
    "token_id:N" strings: the tally gets the ids, a harness that asked for logprobs gets each
    token's own text, and a reply naming its tokens otherwise is refused (not read as ids)."""
    ids, pieces, tok = sampled
    reply = _reply(tok, wants_logprobs=True)
    out = reply.reply(_chunk("".join(pieces), ids, "stop"))
    assert reply.tally.output_ids == ids and reply.tally.logprobs == [-0.5] * len(ids)
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == tok.token_strs(ids)
    assert content[0]["token"] == "<think>" and content[-1]["token"] == "<|im_end|>"
    named = _chunk("".join(pieces), ids, "stop")
    named["choices"][0]["logprobs"]["tokens"] = list(pieces)
    with pytest.raises(ValueError, match="is not 'token_id:N'"):
        _reply(tok).reply(named)


def test_complete_json_check_is_json_loads():
    """`is_complete_json` (its shortcut for an open object or array) answers as `json.loads`
    does, on every prefix of tool-call bodies, with and without whitespace around them."""

    def loads_ok(text: str) -> bool:
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    bodies = [
        '{"name": "run", "arguments": {"cmd": "ls -la }", "n": [1, 2, {"a": null}]}}',
        '[{"name": "x", "arguments": {}}]',
        '{"name": "t", "arguments": "{\\"q\\": 1}"}\n',
        ' {"a": NaN, "b": Infinity}\u3000',
        '"just a string"',
        "12.5e3",
        "{}",
        "[]",
    ]
    for body in bodies:
        for end in range(len(body) + 1):
            for text in (body[:end], body[:end].strip(), body[:end] + " \n"):
                assert is_complete_json(text) == loads_ok(text), repr(text)
