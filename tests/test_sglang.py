"""SGLang pieces on their own: the upstream module, the SGLang normalization, the reference wire."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from polar_reference import PolicyServer, ServerConfig
from polar_reference.scenario import load_scenario

from polar_mitm.tokens.conversation import (
    RequestError,
    sglang_messages,
    sglang_render_input,
    sglang_tools,
)
from polar_mitm.upstream import TokenTally
from polar_mitm.upstream.sglang import SGLang
from tests.helpers import TESTS
from tests.helpers.clients import RUN_SHELL
from tests.helpers.upstreams import aborting_scenario

SCENARIO = TESTS / "scenarios" / "three_turns.json"  # the end-to-end capture tests' script

OTHER_TOOL = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object"}},
}

# -- the upstream module ------------------------------------------------------------------------


def test_request_asks_for_ids_without_streaming():
    """Until the probe has seen sglext ids, every call goes non-streaming with the id flags and
    the sglext flags (the probe: a 0.5.23 answers them in ``sglext``)."""
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
    assert body["return_input_ids_in_sglext"] is body["return_output_ids_in_sglext"] is True
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
        # SGLang 0.5.23's name for the sampled ids
        (
            {"prompt_token_ids": [1, 2, 3], "response_token_ids": [11, 12], "meta_info": META},
            [11, 12],
            [],
        ),
        ({"prompt_token_ids": [1, 2, 3], "token_ids": [11, 12], "meta_info": META}, [11, 12], []),
        ({"prompt_token_ids": [1, 2, 3], "meta_info": META}, [11, 12], []),
        (
            {"prompt_token_ids": [1, 2, 3], "response_token_ids": [11, 13], "meta_info": META},
            [11, 13],
            ["sglang_ids_disagree"],
        ),
        (
            {"prompt_token_ids": [1, 2, 3], "token_ids": [11, 13], "meta_info": META},
            [11, 13],
            ["sglang_ids_disagree"],
        ),
    ],
    ids=["response_token_ids", "token_ids", "meta_info", "disagree", "disagree_older"],
)
def test_ids_from_the_choice_or_meta_info(extra, ids, flags):
    reply, tally = _reply(**extra), TokenTally()
    SGLang("http://x").take_reply(reply, tally)
    assert tally.prompt_ids == [1, 2, 3] and tally.output_ids == ids and tally.saw_output_ids
    assert tally.logprobs == [-0.5, -0.25] and tally.flags == flags
    assert tally.finish_reason == "tool_calls" and tally.count_check() == "ok"
    choice = reply["choices"][0]
    assert not {"prompt_token_ids", "token_ids", "response_token_ids", "meta_info"} & set(choice)
    message = choice["message"]
    assert message["reasoning"] == "r" and "reasoning_content" not in message
    assert "index" not in message["tool_calls"][0]  # the tool's position, not the call's


def test_sglext_ids_switch_streaming_on():
    """The probe: a non-streaming reply with ``sglext.output_ids`` (0.5.23) turns real streaming
    on for the upstream; the ids there are removed from what the harness gets."""
    up = SGLang("http://x")
    assert up.streams_with_tokens is False
    reply = _reply(meta_info=META)
    reply["sglext"] = {"input_ids": [1, 2, 3], "output_ids": [[11, 12]]}
    tally = TokenTally()
    up.take_reply(reply, tally)
    assert "sglext" not in reply and tally.prompt_ids == [1, 2, 3]
    assert up.streams_with_tokens is True
    chat = {"messages": [{"role": "user", "content": "q"}], "return_meta_info": True}
    body = up.request_body(chat, model=None, stream=True, top_logprobs=0)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert not {"return_prompt_token_ids", "return_meta_info", "return_token_ids"} & set(body)
    assert body["return_input_ids_in_sglext"] is body["return_output_ids_in_sglext"] is True
    assert up.request_body(chat, model=None, stream=False, top_logprobs=0)["stream"] is False
    older = SGLang("http://y")  # an SGLang without sglext: the flags ignored, nothing switches
    older.take_reply(_reply(meta_info=META), TokenTally())
    assert older.streams_with_tokens is False


def test_sglext_stream_chunks():
    """An sglext stream: per-chunk logprobs, reasoning_content renamed, the ids at the end."""
    up, tally = SGLang("http://x"), TokenTally()
    head = {"id": "r", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                    "matched_stop": None,
                }
            ],
        },  # noqa: E501
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": "hm"},
                    "logprobs": {"content": [{"token": "hm", "logprob": -0.5}]},
                    "finish_reason": None,
                    "matched_stop": None,
                }
            ],
        },  # noqa: E501
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": None, "content": "ok"},
                    "logprobs": {"content": [{"token": "ok", "logprob": -0.25}]},
                    "finish_reason": None,
                    "matched_stop": None,
                }
            ],
        },  # noqa: E501
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"reasoning_content": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "matched_stop": 7,
                }
            ],
        },  # noqa: E501
        {
            **head,
            "choices": [],
            "usage": None,
            "sglext": {"input_ids": [1, 2], "output_ids": [[5, 6]]},
        },  # noqa: E501
        {**head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
    ]
    for chunk in chunks:
        up.take_chunk(chunk, tally)
    assert chunks[1]["choices"][0]["delta"] == {"reasoning": "hm"}
    assert chunks[2]["choices"][0]["delta"] == {"content": "ok"}
    assert "sglext" not in chunks[4]
    assert tally.prompt_ids == [1, 2] and tally.output_ids == [5, 6] and tally.saw_output_ids
    assert tally.logprobs == [-0.5, -0.25] and tally.finish_reason == "stop"
    assert tally.count_check() == "ok"


def test_generate_body_maps_every_sampling_name():
    """/generate rejects unknown sampling_params keys (400): the chat names are mapped."""
    from polar_mitm.trajectory.exact_prefix import SAMPLING_KEYS

    up = SGLang("http://x")
    sampling = {key: 1 for key in SAMPLING_KEYS} | {"max_tokens": 9}
    assert up.token_in_unsupported(sampling) is None
    body = up.token_in_body([1, 2], sampling, model=None, stream=False)
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 9 and params["min_new_tokens"] == 1
    assert params["sampling_seed"] == 1 and params["no_stop_trim"] == 1
    assert not {"max_tokens", "min_tokens", "seed", "include_stop_str_in_output"} & set(params)
    assert body["return_text_in_logprobs"] is body["return_logprob"] is True
    assert "return_prompt_token_ids" not in body  # the ids sent are the prompt: no echo
    assert up.token_in_unsupported({"best_of": 2}) == "no_sglang_form: best_of"
    with pytest.raises(ValueError, match="no SGLang /generate form"):
        up.token_in_body([1], {"best_of": 2}, model=None, stream=False)


def test_generate_abort_and_an_unasked_prompt_echo():
    up, tally = SGLang("http://x"), TokenTally()
    reply = {
        "text": "hi",
        "output_ids": [11],
        "prompt_token_ids": [1, 2],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None},
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "output_token_logprobs": [[-0.5, 11, "hi"]],
        },
    }
    piece = up.take_text(reply, tally)
    assert piece.finish_reason == tally.finish_reason == "abort"  # not "stop"
    assert tally.abort_message == "Aborted" and tally.prompt_ids is None  # the proxy's own
    assert "prompt_token_ids" not in reply and tally.usage["prompt_tokens"] == 2
    assert piece.tokens == ["hi"]


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


def _serve(kind: str = "sglang", raw: bool = False, **config):
    async def run(requests):
        server = PolicyServer(ServerConfig(scenario=load_scenario(SCENARIO), kind=kind, **config))
        url = await server.start()
        out = []
        try:
            async with aiohttp.ClientSession() as s:
                for method, path, body in requests:
                    async with s.request(method, url + path, json=body) as r:
                        text = await r.text()
                        out.append((r.status, text if raw else json.loads(text)))
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
    # 0.5.23: the call's ordinal (0), not the tool's position in tools (1) as before
    assert call["index"] == 0 and call["function"]["name"] == "run_shell"
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert json.loads(call["function"]["arguments"]) == {"cmd": "cat notes.txt"}
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    triples = choice["meta_info"]["output_token_logprobs"]
    assert choice["response_token_ids"] == [t[1] for t in triples] and "token_ids" not in choice
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


def _serve_raw(kind: str = "sglang", **config):
    """Like `_serve`, but the raw body text (an SSE stream is not one JSON value)."""
    return _serve(kind, raw=True, **config)


def _sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_reference_sglang_streams_with_sglext_ids():
    """0.5.23: a stream with the sglext flags, ids in a final `choices: []` chunk; the same ids
    as the non-streaming reply; without the flags (or with --no-sglext) no sglext chunk."""
    sglext = {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    stream = {**TOOL_TURN, "stream": True, "stream_options": {"include_usage": True}, **sglext}
    flags = {"return_prompt_token_ids": True, "return_token_ids": True, **sglext}
    (s1, text), (s2, whole) = _serve_raw()(
        ("POST", CHAT, stream), ("POST", CHAT, {**TOOL_TURN, **flags})
    )
    assert (s1, s2) == (200, 200) and text.endswith("data: [DONE]\n\n")
    chunks = _sse(text)
    whole = json.loads(whole)
    [ext] = [c for c in chunks if "sglext" in c]
    assert ext["choices"] == [] and ext["usage"] is None
    choice = whole["choices"][0]
    assert ext["sglext"] == {
        "input_ids": choice["prompt_token_ids"],
        "output_ids": [choice["response_token_ids"]],
    }
    assert whole["sglext"] == ext["sglext"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(choice["response_token_ids"])
    lps = [
        e["logprob"]
        for c in chunks
        for ch in c["choices"]
        for e in (ch["logprobs"] or {}).get("content", [])
    ]  # noqa: E501
    assert lps == [e["logprob"] for e in choice["logprobs"]["content"]]
    finish = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert [f["finish_reason"] for f in finish] == ["tool_calls"]
    calls = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("tool_calls") or ()]
    assert calls and all(t["index"] == 0 for t in calls)  # the call's ordinal
    assert all("reasoning_content" in ch["delta"] for c in chunks for ch in c["choices"])
    [(status, older)] = _serve_raw(sglext=False)(("POST", CHAT, stream))
    assert status == 200 and not [c for c in _sse(older) if "sglext" in c]


def test_reference_generate_is_strict_and_can_abort(tmp_path):
    """/generate: unknown sampling keys are SGLang's contract 400; text in the triples only with
    return_text_in_logprobs; the prompt echoed with return_prompt_token_ids; a scripted abort."""
    from polar_reference.render import Renderer

    from polar_mitm.assets import qwen3_tokenizer_dir

    renderer = Renderer(qwen3_tokenizer_dir())
    prompt = renderer.prompt(sglang_render_input(TOOL_TURN)).ids
    base = {"input_ids": list(prompt), "return_logprob": True}
    results = _serve()(
        ("POST", "/generate", {**base, "sampling_params": {"max_new_tokens": 8, "min_tokens": 1}}),
        ("POST", "/generate", {**base, "sampling_params": {"max_new_tokens": 8}}),
        (
            "POST",
            "/generate",
            {
                **base,
                "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 1},
                "return_text_in_logprobs": True,
                "return_prompt_token_ids": True,
            },
        ),
    )
    (s1, refused), (s2, bare), (s3, full) = results
    assert s1 == 400 and refused["error"].startswith(
        "unknown field `min_tokens`, expected one of `max_new_tokens`, `stop`,"
    )
    assert s2 == s3 == 200
    assert all(t[2] is None for t in bare["meta_info"]["output_token_logprobs"])
    assert "prompt_token_ids" not in bare
    assert all(isinstance(t[2], str) and t[2] for t in full["meta_info"]["output_token_logprobs"])
    assert full["prompt_token_ids"] == list(prompt)
    aborting = aborting_scenario(SCENARIO, tmp_path)
    server_cfg = ServerConfig(scenario=load_scenario(aborting), kind="sglang")

    async def run():
        server = PolicyServer(server_cfg)
        url = await server.start()
        try:
            async with aiohttp.ClientSession() as s:
                body = {**base, "sampling_params": {"max_new_tokens": 8}}
                async with s.post(url + "/generate", json=body) as r:
                    return r.status, await r.json()
        finally:
            await server.stop()

    status, aborted = asyncio.run(run())
    assert status == 200 and aborted["meta_info"]["finish_reason"]["type"] == "abort"
