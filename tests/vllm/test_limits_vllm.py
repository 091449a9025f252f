"""The context limits on the real vLLM (max_model_len 40960, the tiny Qwen3's): an output cap
above it is refused and the proxy asks once more without it; one that fits the context but not
beside the prompt goes through as vLLM handles it; a prompt longer than the context is refused,
reaches the harness as its dialect's error and is never resent."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.e2e.loopback.test_capture_e2e import calls_of
from tests.e2e.loopback.test_dialects_e2e import anthropic_client
from tests.helpers.clients import openai_client

from ..e2e.test_harnesses import CAP_REFUSED
from .checks import check_exact

CHAT = [{"role": "user", "content": "[chat] hello"}]
# about 50,000 tokens: past the 40960 context
HUGE = " ".join(["lorem"] * 50_000)


@pytest.mark.parametrize("cap", [50_000, 40_900])
def test_output_cap(vllm, recorder, make_mitm, cap):
    mitm = make_mitm(recorder.url)
    client = openai_client(mitm, api_key="polar-vcap.0")
    reply = client.chat.completions.create(model="gpt-4.1", messages=CHAT, max_tokens=cap)
    assert reply.choices[0].message.content.strip() == "Hello from the real vLLM."
    [row] = calls_of(mitm)
    assert row["status"] == "completed" and row["trainable"] is True
    sent = recorder.chats()
    refused = [e for e in sent if e.status == 400]
    if cap > 40960:  # refused for the cap alone, then asked without it
        assert len(sent) == 2 and len(refused) == 1, [e.raw[:200] for e in sent]
        assert CAP_REFUSED.search(refused[0].raw.decode()), refused[0].raw
        assert sent[0].body["max_tokens"] == cap and "max_tokens" not in sent[1].body
        assert any(f"max_tokens={cap} dropped" in n for n in row["translation_notes"])
    else:  # fits the context: vLLM takes it as it is (clamped beside the prompt)
        assert [e.status for e in sent] == [200] and sent[0].body["max_tokens"] == cap
    check_exact([row], recorder)


def test_prompt_too_long(vllm, recorder, make_mitm):
    mitm = make_mitm(recorder.url)
    oai = openai_client(mitm, api_key="polar-vlong.0")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="gpt-4.1", messages=[{"role": "user", "content": HUGE}])
    assert "maximum context length" in str(e.value.message), e.value.message
    ant = anthropic_client(mitm, api_key="polar-vlong.1")
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=1024,
            messages=[{"role": "user", "content": HUGE}],
        )
    assert e.value.body["type"] == "error"
    assert "maximum context length" in e.value.body["error"]["message"]
    rows = calls_of(mitm)
    assert [(r["status"], r["http_status"]) for r in rows] == [("error", 400)] * 2
    sent = recorder.chats()
    assert [e.status for e in sent] == [400, 400]  # refused once each, never resent
