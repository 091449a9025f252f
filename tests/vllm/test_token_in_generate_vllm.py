"""polar_token_in=generate on the real vLLM (0.32, started with --enable-scale-out): exact-prefix
mode's token-in calls go to ``/inference/v1/generate`` with ``detokenize: false``; the proxy's
decoding of the sampled ids is the text vLLM's ``/v1/completions`` gives for the same prompt ids,
and the records hold the engine's own ids and logprobs."""

from __future__ import annotations

import httpx

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.tokens.detok import vllm_text
from polar_mitm.tokens.tokenizer import load_tokenizer
from tests.e2e.loopback.test_exact_prefix_e2e import converse, records
from tests.helpers.clients import completion_ids, openai_client

from .checks import check_exact
from .recorder import Recorder

GENERATE = "/inference/v1/generate"


def test_generate_route_decodes_as_completions(vllm, make_mitm):
    tok = str(qwen3_tokenizer_dir())
    rec = Recorder(vllm.url)
    try:
        mitm = make_mitm(
            rec.url, polar_tokenizer=tok, polar_exact_prefix="true", polar_token_in="generate"
        )
        with openai_client(mitm, api_key="polar-vgen.0") as client:
            replies, _ = converse(client, True, drift=True)
        assert mitm.stop() == 0
    finally:
        rec.stop()
    assert len(replies) == 4 and replies[-1]["finish"] == "stop"
    calls, [trace] = records(mitm.output, "vgen.0")
    assert [c["route"] for c in calls] == ["chat", "token_in", "token_in", "token_in"]
    posts = [e for e in rec.exchanges if e.method == "POST"]
    assert [e.path for e in posts] == ["/v1/chat/completions", *[GENERATE] * 3]
    check_exact(calls, rec)
    assert trace["trainable"] is True, trace["untrainable_reason"]
    assert trace["input_ids"] == calls[-1]["prompt_token_ids"] + calls[-1]["output_token_ids"]

    policy = load_tokenizer(tok)
    for exchange in posts[1:]:
        params = dict(exchange.body["sampling_params"])
        assert params.pop("detokenize") is False and params.pop("logprobs") == 0
        [choice] = exchange.reply["choices"]
        completed = httpx.post(
            vllm.url + "/v1/completions",
            json={
                "model": exchange.body["model"],
                "prompt": exchange.body["token_ids"],
                **params,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
            timeout=300,
        ).json()["choices"][0]
        assert completion_ids(completed) == choice["token_ids"]
        assert completed["finish_reason"] == choice["finish_reason"]
        decoded = vllm_text(
            policy, exchange.body["token_ids"], choice["token_ids"], params, choice["finish_reason"]
        )
        assert decoded == completed["text"]
    # the decoding options a harness may send, on the last call's ids
    last = posts[-1]
    for extra in (
        {"skip_special_tokens": False},
        {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        {"skip_special_tokens": False, "include_stop_str_in_output": True},
    ):
        params = {**last.body["sampling_params"], **extra}
        generated = httpx.post(
            vllm.url + GENERATE, json={**last.body, "sampling_params": params}, timeout=300
        ).json()["choices"][0]
        params.pop("detokenize")
        completed = httpx.post(
            vllm.url + "/v1/completions",
            json={"model": last.body["model"], "prompt": last.body["token_ids"], **params},
            timeout=300,
        ).json()["choices"][0]
        decoded = vllm_text(policy, last.body["token_ids"], generated["token_ids"], params, "stop")
        assert generated["finish_reason"] == "stop"
        assert decoded == completed["text"], extra
