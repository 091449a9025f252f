"""Exact-prefix mode on the real vLLM: the same drifting harness as
tests/e2e/loopback/test_exact_prefix_e2e.py (it drops earlier reasoning, re-serializes tool
arguments, then asks a follow-up) in chat mode and in exact-prefix mode. Chat mode breaks the chain
where vLLM's template re-renders the drifted turns; exact-prefix mode sends the policy's own tokens
to vLLM's token-in `/v1/completions` and keeps one chain, with the engine's own ids and logprobs
(re-scored)."""

from __future__ import annotations

import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.e2e.loopback.test_exact_prefix_e2e import converse, records, seen
from tests.helpers.clients import openai_client

from .checks import check_exact, check_rescoring
from .recorder import Recorder


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_exact_prefix_keeps_one_chain(vllm, make_mitm, stream):
    tok = str(qwen3_tokenizer_dir())
    chat_rec, exact_rec = Recorder(vllm.url), Recorder(vllm.url)
    try:
        chat_mitm = make_mitm(chat_rec.url, polar_tokenizer=tok)
        exact_mitm = make_mitm(exact_rec.url, polar_tokenizer=tok, polar_exact_prefix="true")
        with openai_client(chat_mitm, api_key="polar-vdrift.0") as client:
            chat_replies, _ = converse(client, stream, drift=True)
        with openai_client(exact_mitm, api_key="polar-vdrift.1") as client:
            exact_replies, _ = converse(client, stream, drift=True)
        assert chat_mitm.stop() == 0 and exact_mitm.stop() == 0
    finally:
        chat_rec.stop()
        exact_rec.stop()
    assert [seen(r) for r in exact_replies] == [seen(r) for r in chat_replies]
    assert len(exact_replies) == 4 and exact_replies[-1]["finish"] == "stop"

    calls, traces = records(chat_mitm.output, "vdrift.0")
    assert "rerender" in {t["break_reason"] for t in traces}

    calls, traces = records(exact_mitm.output, "vdrift.1")
    assert [c["route"] for c in calls] == ["chat", "token_in", "token_in", "token_in"]
    assert [e.path for e in exact_rec.exchanges if e.method == "POST"] == [
        "/v1/chat/completions",
        *["/v1/completions"] * 3,
    ]
    check_exact(calls, exact_rec)
    [trace] = traces
    assert trace["trainable"] is True, trace["untrainable_reason"]
    assert trace["input_ids"] == calls[-1]["prompt_token_ids"] + calls[-1]["output_token_ids"]
    scored = check_rescoring(vllm.url, trace)
    assert scored.constrained_tokens == 0
    print(scored)
