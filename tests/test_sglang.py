"""SGLang pieces on their own: the upstream module, the SGLang normalization, the reference wire."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from polar_mitm.conversation import RequestError, sglang_messages, sglang_render_input, sglang_tools
from polar_mitm.policy_server import PolicyServer, ServerConfig
from polar_mitm.policy_server.scenario import load_scenario
from polar_mitm.upstream import TokenTally
from polar_mitm.upstream.sglang import SGLang

from .clients import RUN_SHELL
from .test_capture_e2e import SCENARIO

OTHER_TOOL = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object"}},
}

# -- the upstream module ------------------------------------------------------------------------


def test_request_asks_for_ids_without_streaming():
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "thought"},
        {"role": "user", "content": "q2"},
    ]
    chat = {"messages": history, "stream_options": {"include_usage": True}, "max_tokens": 5}
    body = SGLang("http://x").request_body(chat, model="m", stream=True, top_logprobs=0)
    assert body["stream"] is False and "stream_options" not in body and "top_logprobs" not in body
    assert body["return_prompt_token_ids"] is body["return_meta_info"] is body["return_token_ids"]
    assert body["return_token_ids"] is True and body["logprobs"] is True and body["model"] == "m"
    # SGLang's request model has no `reasoning`: the prior thinking must travel as reasoning_content
    assert body["messages"][1] == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "thought",
    }
    assert chat["messages"][1]["reasoning"] == "thought"  # the harness's body is not modified
    assert (
        SGLang("http://x").request_body(chat, model=None, stream=False, top_logprobs=3)[
            "top_logprobs"
        ]
        == 3
    )


def _reply(**choice_extra) -> dict:
    message = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "r",
        "tool_calls": [
            {
                "id": "call_1",
                "index": 1,
                "type": "function",
                "function": {"name": "run_shell", "arguments": "{}"},
            }
        ],
    }
    return {
        "id": "x",
        "model": "m",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls",
                "matched_stop": None,
                **choice_extra,
            }
        ],
    }


META = {"output_token_logprobs": [[-0.5, 11, "a"], [-0.25, 12, "b"]], "completion_tokens": 2}


@pytest.mark.parametrize(
    ("extra", "ids", "flags"),
    [
        ({"prompt_token_ids": [1, 2, 3], "token_ids": [11, 12], "meta_info": META}, [11, 12], []),
        ({"prompt_token_ids": [1, 2, 3], "meta_info": META}, [11, 12], []),
        (
            {"prompt_token_ids": [1, 2, 3], "token_ids": [11, 13], "meta_info": META},
            [11, 13],
            ["sglang_ids_disagree"],
        ),
    ],
    ids=["token_ids", "meta_info", "disagree"],
)
def test_ids_from_the_choice_or_meta_info(extra, ids, flags):
    reply, tally = _reply(**extra), TokenTally()
    SGLang("http://x").take_reply(reply, tally)
    assert tally.prompt_ids == [1, 2, 3] and tally.output_ids == ids and tally.saw_output_ids
    assert tally.logprobs == [-0.5, -0.25] and tally.flags == flags
    assert tally.finish_reason == "tool_calls" and tally.count_check() == "ok"
    choice = reply["choices"][0]
    assert not {"prompt_token_ids", "token_ids", "meta_info"} & set(choice)
    message = choice["message"]
    assert message["reasoning"] == "r" and "reasoning_content" not in message
    assert "index" not in message["tool_calls"][0]  # the tool's position, not the call's


def test_a_reply_without_ids_is_detected():
    """An SGLang that ignored the flags: no meta_info, no ids; only the OpenAI logprobs."""
    reply = _reply(
        logprobs={"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1}]}
    )
    tally = TokenTally()
    SGLang("http://x").take_reply(reply, tally)
    assert tally.prompt_ids is None and not tally.saw_output_ids and tally.output_ids == []
    assert tally.logprobs == [-0.5, -1.0]


def test_missing_ids_warn_once_per_upstream(caplog):
    a, b = SGLang("http://a"), SGLang("http://b")
    with caplog.at_level("WARNING", logger="polar_mitm"):
        for _ in range(3):
            a.warn_missing_ids("x")
            b.warn_missing_ids("x")
    warnings = [r.getMessage() for r in caplog.records if "returned no token ids" in r.getMessage()]
    assert len(warnings) == 2 and "http://a" in warnings[0] and "http://b" in warnings[1]


# -- SGLang's normalization -----------------------------------------------------------------------


def test_sglang_normalization():
    messages = [
        {
            "role": "System",
            "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": "hi", "name": None},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "dropped",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": '{"cmd": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "assistant", "content": "last"},
    ]
    conv = sglang_messages(messages)
    assert conv[0] == {"role": "system", "content": "be brief"}  # a space, not vLLM's newline
    assert conv[1] == {"role": "user", "content": "hi"}
    assert conv[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "index": None,
                "type": "function",
                "function": {"name": "run_shell", "arguments": {"cmd": "ls"}},
            }
        ],
    }
    assert conv[3] == {"role": "tool", "content": "a.txt", "tool_call_id": "c1"}
    assert conv[4] == {"role": "user", "content": "last"}  # a final assistant turn becomes user
    with pytest.raises(RequestError, match="must be valid JSON"):
        sglang_messages(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
                }
            ]
        )
    with pytest.raises(RequestError, match="'role' must be one of"):
        sglang_messages([{"role": "robot", "content": "x"}])


def test_sglang_tools_and_template_kwargs():
    dumped = sglang_tools([RUN_SHELL], "auto")
    assert dumped == [
        {
            "type": "function",
            "function": {
                "description": RUN_SHELL["function"]["description"],
                "name": "run_shell",
                "parameters": RUN_SHELL["function"]["parameters"],
                "strict": False,
            },
            "defer_loading": None,
        }
    ]
    assert sglang_tools([RUN_SHELL], "none") is None
    named = {"type": "function", "function": {"name": "read_file"}}
    assert [t["function"]["name"] for t in sglang_tools([RUN_SHELL, OTHER_TOOL], named)] == [
        "read_file"
    ]
    inp = sglang_render_input(
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"}
    )
    assert inp.kwargs == {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
    assert inp.tools is None  # no tools: tool_choice defaults to none


# -- the reference server's SGLang mode ---------------------------------------------------------


def _serve(kind: str = "sglang", **config):
    async def run(requests):
        server = PolicyServer(ServerConfig(scenario=load_scenario(SCENARIO), kind=kind, **config))
        url = await server.start()
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for method, path, body in requests:
                    async with s.request(method, url + path, json=body) as r:
                        out.append((r.status, await r.json(content_type=None)))
        finally:
            await server.stop()
        return out

    return lambda *requests: asyncio.run(run(list(requests)))


CHAT = "/v1/chat/completions"
TOOL_TURN = {
    "model": "Qwen/Qwen3-4B",
    "messages": [{"role": "user", "content": "lines?"}],
    "tools": [OTHER_TOOL, RUN_SHELL],
    "logprobs": True,
}


def test_reference_sglang_wire():
    flags = {"return_prompt_token_ids": True, "return_meta_info": True, "return_token_ids": True}
    results = _serve()(
        ("POST", CHAT, {**TOOL_TURN, **flags}),
        ("POST", CHAT, {**TOOL_TURN, "stream": True, "return_meta_info": True}),
        ("POST", CHAT, {**TOOL_TURN, "stream": True, "return_token_ids": True}),
        ("GET", "/v1/models", None),
    )
    (status, reply), (s2, refused), (s3, refused2), (_, models) = results
    assert status == 200
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["index"] == 1 and call["function"]["name"] == "run_shell"  # the tool's position
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert json.loads(call["function"]["arguments"]) == {"cmd": "cat notes.txt"}
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    triples = choice["meta_info"]["output_token_logprobs"]
    assert choice["token_ids"] == [t[1] for t in triples]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [t[0] for t in triples]
    assert (
        reply["usage"]["completion_tokens"]
        == len(triples)
        == choice["meta_info"]["completion_tokens"]
    )
    assert reply["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert choice["meta_info"]["finish_reason"] == {"type": "tool_calls", "matched": None}
    assert reply["model"] == "Qwen/Qwen3-4B" and reply["metadata"] == {"weight_version": "default"}
    assert (s2, s3) == (400, 400)
    assert refused == {
        "object": "error",
        "message": "return_meta_info is not supported with "
        "streaming. Please set stream=false when using return_meta_info=true.",
        "type": "BadRequest",
        "param": None,
        "code": 400,
    }
    assert "return_token_ids is not supported with streaming" in refused2["message"]
    assert models["data"][0]["owned_by"] == "sglang"


def test_reference_servers_ignoring_token_flags():
    flags = {"return_prompt_token_ids": True, "return_meta_info": True, "return_token_ids": True}
    [(status, reply)] = _serve(ignore_token_flags=True)(("POST", CHAT, {**TOOL_TURN, **flags}))
    assert status == 200
    assert not {"prompt_token_ids", "token_ids", "meta_info"} & set(reply["choices"][0])
    assert reply["choices"][0]["logprobs"]["content"]  # logprobs still work on old servers
    [(status, reply)] = _serve("vllm", ignore_token_flags=True)(
        ("POST", CHAT, {**TOOL_TURN, **flags})
    )
    assert status == 200 and reply["prompt_token_ids"] is None
    assert reply["choices"][0]["token_ids"] is None
