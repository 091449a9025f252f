"""polar_token_in=generate end to end: real mitmdump + addon, the reference server imitating vLLM
0.32's ``POST /inference/v1/generate`` (ids only, ``--enable-scale-out``; HTTP 403 without it).

The proxy decodes the sampled ids itself; the harness must see exactly what the /v1/completions
route gives it, in the three dialects, and the records the same ids and logprobs.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.e2e.loopback.test_capture_e2e import test_startup_option_errors as startup_errors
from tests.e2e.loopback.test_exact_prefix_e2e import (
    SCENARIO,
    _messages_conversation,
    _responses_conversation,
    ask,
    converse,
    records,
    seen,
)
from tests.helpers.clients import openai_client

GENERATE = "/inference/v1/generate"


@pytest.mark.parametrize("dialect", ["openai_chat", "anthropic_messages", "openai_responses"])
def test_generate_route_streams_the_same_to_the_harness(make_policy_server, make_mitm, dialect):
    from tests.e2e.loopback.test_dialects_e2e import SCENARIO as DIALECTS

    server = make_policy_server(
        SCENARIO if dialect == "openai_chat" else DIALECTS, "--enable-scale-out"
    )
    tok = str(qwen3_tokenizer_dir())
    relayed = make_mitm(server.url, polar_tokenizer=tok, polar_exact_prefix="true")
    generate = make_mitm(
        server.url, polar_tokenizer=tok, polar_exact_prefix="true", polar_token_in="generate"
    )

    def talk(mitm, rollout: str) -> list:
        if dialect == "openai_chat":
            with openai_client(mitm, api_key=f"polar-{rollout}") as client:
                return [seen(r) for r in converse(client, stream=True, drift=False)[0]]
        converse_in = (
            _messages_conversation if dialect == "anthropic_messages" else _responses_conversation
        )
        return converse_in(mitm, rollout)[0]

    relayed_seen = talk(relayed, "gen.0")
    sent_before = len(httpx.get(server.url + "/_polar/requests", timeout=10).json())
    generate_seen = talk(generate, "gen.1")
    assert relayed.stop() == 0 and generate.stop() == 0
    assert generate_seen == relayed_seen and len(generate_seen) >= 3

    upstream = httpx.get(server.url + "/_polar/requests", timeout=10).json()[sent_before:]
    paths = [u["path"] for u in upstream if u["method"] == "POST" and "_polar" not in u["path"]]
    assert paths[0] == "/v1/chat/completions" and set(paths[1:]) == {GENERATE}
    for u in upstream:
        if u["path"] == GENERATE:
            body = u["body"]
            assert body["output_mode"] == "tokens" and "stream" not in body
            params = body["sampling_params"]
            assert params["detokenize"] is False and params["logprobs"] == 0
            assert params["max_tokens"] > 0

    relay_calls, _ = records(relayed.output, "gen.0")
    calls, [trace] = records(generate.output, "gen.1")
    assert [c["route"] for c in calls] == [c["route"] for c in relay_calls]
    assert {c["route"] for c in calls} == {"chat", "token_in"}
    for relay, call in zip(relay_calls, calls, strict=True):
        assert call["status"] == "completed" and call["trainable"], call
        assert call["prompt_token_ids"] == relay["prompt_token_ids"]
        assert call["output_token_ids"] == relay["output_token_ids"]
        assert call["output_logprobs"] == pytest.approx(relay["output_logprobs"])
        assert call["response_json"] is not None
    last = calls[-1]
    assert trace["input_ids"] == last["prompt_token_ids"] + last["output_token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_generate_route_without_scale_out_fails_naming_the_fix(
    make_policy_server, make_mitm, stream
):
    """vLLM without --enable-scale-out answers 403: the harness gets its dialect's error saying
    what to change, the record says so, and the chain's first (chat) call is unaffected."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url,
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_exact_prefix="true",
        polar_token_in="generate",
    )
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "What is the last line of notes.txt?"},
    ]
    with openai_client(mitm, api_key="polar-noscale.0") as client:
        reply = ask(client, messages, stream=stream)
        [call] = reply["tool_calls"]
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "notes.txt"},
        ]
        with pytest.raises(openai.APIStatusError) as failed:
            ask(client, messages, stream=stream)
    assert failed.value.status_code == 403
    text = str(failed.value)
    assert "--enable-scale-out" in text and "vLLM >= 0.32" in text and "Scale-out" in text
    assert "polar-mitm sent model" not in text
    assert mitm.stop() == 0
    calls, _ = records(mitm.output, "noscale.0")
    assert [(c["route"], c["status"], c["http_status"]) for c in calls] == [
        ("chat", "completed", 200),
        ("token_in", "error", 403),
    ]
    assert "--enable-scale-out" in calls[1]["error"]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (
            {
                "polar_upstream": "http://127.0.0.1:9",
                "polar_upstream_kind": "sglang",
                "polar_tokenizer": str(qwen3_tokenizer_dir()),
                "polar_exact_prefix": "true",
                "polar_token_in": "generate",
            },
            "polar_token_in=generate: vLLM's /inference/v1/generate needs polar_upstream_kind=vllm",
        ),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_token_in": "tokens"},
            "polar_token_in: 'tokens' is not 'completions' or 'generate'",
        ),
    ],
    ids=["sglang", "unknown"],
)
def test_polar_token_in_startup_errors(tmp_path, confdir, options, needle):
    startup_errors(tmp_path, confdir, options, needle)
