"""vLLM 0.33 and SGLang 0.5.23 as they really are (issue 21), end to end: real mitmdump + addon,
real HTTPS through the proxy, the reference policy server imitating those releases
(`reference/polar_reference/versions.py`; docs/upstreams.md cites the servers' source).

Each test is one finding of the audit: the output-cap refusal and clamp of vLLM 0.33 (and older
vLLM's texts), a prompt too long by itself (answered at once, never resent), `include_reasoning:
false` (never forwarded: vLLM would drop the ids), SGLang streaming with sglext ids (probed once,
then a real stream: first byte before the generation ends) and SGLang's `abort` finish.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.loopback.test_capture_e2e import calls_of
from tests.helpers import TESTS
from tests.helpers.clients import RUN_SHELL, http_client, openai_client
from tests.helpers.upstreams import aborting_scenario

GOLDEN = TESTS / "golden"
DIALECTS = TESTS / "scenarios" / "dialects.json"
THREE_TURNS = TESTS / "scenarios" / "three_turns.json"
MESSAGES_URL = "https://api.anthropic.com/v1/messages?beta=true"
CHAT_URL = "https://api.openai.com/v1/chat/completions"
DROPPED = "max_tokens=128000 dropped"


def upstream_chats(server_url: str) -> list[dict]:
    log = httpx.get(server_url + "/_polar/requests", timeout=10).json()
    return [e["body"] for e in log if e["path"] == "/v1/chat/completions"]


def claude_turn(mitm, key: str, max_tokens: int = 128000) -> httpx.Response:
    """Claude Code 2.1.328's recorded first request (max_tokens 128000, ~11k prompt tokens)."""
    recorded = json.loads((GOLDEN / "claude_turn1.json").read_text())
    recorded["body"]["max_tokens"] = max_tokens
    skip = ("content-length", "content-type", "x-api-key", "accept-encoding")
    headers = {k: v for k, v in recorded["headers"].items() if k.lower() not in skip}
    headers["x-api-key"] = key
    with http_client(mitm) as c:
        r = c.post(MESSAGES_URL, json=recorded["body"], headers=headers)
        r.read()
        return r


@pytest.mark.parametrize(
    ("max_model_len", "limits", "requests"),
    [(32768, "0.33", 2), (131072, "0.33", 1), (131072, "0.10", 2)],
    ids=["0.33-32k-refused", "0.33-128k-clamped", "0.10-128k-refused"],
)
def test_output_cap_one_request_when_it_fits_two_when_refused(
    make_policy_server, make_mitm, max_model_len, limits, requests
):
    """Claude Code's max_tokens=128000: vLLM 0.33 refuses it above max_model_len (the proxy
    resends without it) and clamps it below (one request, cap kept); vLLM 0.10 refused it
    whenever it did not fit beside the prompt."""
    server = make_policy_server(
        DIALECTS, "--max-model-len", str(max_model_len), "--vllm-limits", limits
    )
    mitm = make_mitm(server.url)
    r = claude_turn(mitm, "polar-cap.0")
    assert r.status_code == 200, r.text
    assert "event: message_stop" in r.text
    chats = upstream_chats(server.url)
    assert len(chats) == requests, [c.get("max_tokens") for c in chats]
    assert chats[0]["max_tokens"] == 128000
    if requests == 2:
        assert "max_tokens" not in chats[1]
    [row] = calls_of(mitm)
    assert row["status"] == "completed" and row["trainable"] is True, row["error"]
    notes = [n for n in row["translation_notes"] or [] if DROPPED in n]
    assert len(notes) == requests - 1, row["translation_notes"]


@pytest.mark.parametrize(
    ("kind", "max_tokens", "requests"),
    [("vllm", 2048, 1), ("sglang", 2048, 1), ("vllm", 128000, 2)],
    ids=["vllm", "sglang", "vllm-cap-first"],
)
def test_prompt_too_long_is_answered_at_once(
    make_policy_server, make_mitm, kind, max_tokens, requests
):
    """A prompt longer than the whole context: the harness gets the server's refusal in its
    dialect (Anthropic's error object) at once; it is never resent. vLLM 0.33 checks the cap
    first, so a cap above the context is refused (and dropped) before the prompt is."""
    server = make_policy_server(DIALECTS, "--max-model-len", "4096", kind=kind)
    mitm = make_mitm(server.url, polar_upstream_kind=kind)
    r = claude_turn(mitm, "polar-long.0", max_tokens)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    want = "without any output tokens" if kind == "vllm" else "is longer than the model's context"
    assert want in error["error"]["message"]
    assert len(upstream_chats(server.url)) == requests
    [row] = calls_of(mitm)
    assert row["status"] == "error" and row["http_status"] == 400
    notes = [n for n in row["translation_notes"] or [] if DROPPED in n]
    assert len(notes) == requests - 1, notes


def test_include_reasoning_false_is_not_forwarded(make_policy_server, make_mitm):
    """vLLM drops token_ids and logprobs from a reply with include_reasoning false: the proxy
    keeps it from the server (exact ids in the record) and leaves the reasoning out of the
    harness's reply itself."""
    server = make_policy_server(THREE_TURNS)
    mitm = make_mitm(server.url)
    client = openai_client(mitm, api_key="polar-noreason.0")
    messages = [{"role": "user", "content": "How many lines does notes.txt have?"}]
    stream = client.chat.completions.create(
        model="gpt-4.1-mini",
        messages=messages,
        tools=[RUN_SHELL],
        stream=True,
        extra_body={"include_reasoning": False},
    )
    deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
    whole = client.chat.completions.create(
        model="gpt-4.1-mini",
        messages=messages,
        tools=[RUN_SHELL],
        extra_body={"include_reasoning": False},
    )
    assert not [d for d in deltas if d.get("reasoning") or d.get("reasoning_content")]
    message = whole.choices[0].message.model_dump()
    assert not message.get("reasoning") and message["tool_calls"]
    assert all("include_reasoning" not in body for body in upstream_chats(server.url))
    rows = calls_of(mitm)
    assert len(rows) == 2
    for row in rows:
        assert row["ids_source"] == "upstream" and row["trainable"] is True, row
        assert len(row["output_logprobs"]) == len(row["output_token_ids"]) > 0
        assert "I should look at the file first." in json.loads(row["response_json"])["choices"][0][
            "message"
        ].get("reasoning", "")


def _timed_stream(mitm, key: str) -> tuple[float, float, list[dict]]:
    """(seconds to the first byte, seconds to the last, the chunks) of one streaming call."""
    body = {
        "model": "gpt-4.1-mini",
        "messages": [{"role": "user", "content": "How many lines does notes.txt have?"}],
        "tools": [RUN_SHELL],
        "stream": True,
    }
    with http_client(mitm) as c:
        start = time.perf_counter()
        first = None
        lines = []
        headers = {"authorization": f"Bearer {key}"}
        with c.stream("POST", CHAT_URL, json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if first is None and line:
                    first = time.perf_counter() - start
                lines.append(line)
        total = time.perf_counter() - start
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert first is not None
    return first, total, chunks


@pytest.mark.parametrize("sglext", [True, False], ids=["sglext", "older"])
def test_sglang_streams_with_ids_once_probed(make_policy_server, make_mitm, sglext):
    """SGLang 0.5.23: the first call (the probe) goes non-streaming and finds sglext ids; the
    next streams for real, its first byte long before the generation ends, with exact ids. An
    SGLang without sglext (--no-sglext) keeps every call non-streaming: first byte at the end."""
    extra = ["--token-rate", "40"] + ([] if sglext else ["--no-sglext"])
    server = make_policy_server(THREE_TURNS, *extra, kind="sglang")
    mitm = make_mitm(server.url, polar_upstream_kind="sglang")
    _timed_stream(mitm, "polar-sgl.0")
    first, total, chunks = _timed_stream(mitm, "polar-sgl.1")
    assert chunks[-1]["choices"][0]["finish_reason"]  # the harness asked no usage
    assert not [c for c in chunks if "sglext" in c or not c["choices"]]  # ids stay upstream
    bodies = upstream_chats(server.url)
    assert [b["stream"] for b in bodies] == [False, sglext]
    rows = calls_of(mitm)
    # The server takes at least (n - 1) / 40 s to generate n tokens at --token-rate 40; a busy
    # machine only adds to that, so the checks are lower bounds: a real stream spreads its bytes
    # over the generation, a whole reply sends its first byte only once the generation ended.
    pacing = (len(rows[-1]["output_token_ids"]) - 1) / 40
    assert pacing > 0.3  # ~20 tokens
    if sglext:
        assert total - first > pacing / 2, (first, total, pacing)
    else:
        assert first > pacing * 0.8, (first, total, pacing)
    truth = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            **{k: v for k, v in bodies[1].items() if k not in ("stream", "stream_options")},
            "stream": False,
            "return_token_ids": True,
            "return_prompt_token_ids": True,
            "logprobs": True,
        },
        timeout=60,
    ).json()["choices"][0]
    for row in rows:
        assert row["ids_source"] == "upstream" and row["trainable"] is True, row
        assert row["count_check"] == "ok"
        assert row["prompt_token_ids"] == truth["prompt_token_ids"]
        assert row["output_token_ids"] == truth["response_token_ids"]
        lps = [e["logprob"] for e in truth["logprobs"]["content"]]
        assert row["output_logprobs"] == pytest.approx(lps, abs=1e-6)


def test_sglang_abort_is_an_error(make_policy_server, make_mitm, tmp_path):
    """SGLang ends an aborted generation with finish_reason `abort` and HTTP 200: the harness
    gets an error (not a `stop`), the record says `error` — whole replies (a 502 in the dialect)
    and real sglext streams (under way: the dialect's error event) alike."""
    server = make_policy_server(aborting_scenario(THREE_TURNS, tmp_path), kind="sglang")
    mitm = make_mitm(server.url, polar_upstream_kind="sglang")
    body = {
        "model": "gpt-4.1-mini",
        "messages": [{"role": "user", "content": "How many lines does notes.txt have?"}],
    }
    replies = []
    with http_client(mitm) as c:
        for stream in (False, True):  # the first call is the probe: non-streaming
            r = c.post(
                CHAT_URL,
                json={**body, "stream": stream},
                headers={"authorization": "Bearer polar-abort.0"},
            )
            replies.append((r.status_code, r.text))
    assert [b["stream"] for b in upstream_chats(server.url)] == [False, True]
    status, text = replies[0]
    assert status == 502 and "aborted the generation" in json.loads(text)["error"]["message"]
    status, text = replies[1]
    assert status == 200 and "aborted the generation" in text, text
    assert '"finish_reason": "abort"' not in text and '"finish_reason":"abort"' not in text
    rows = calls_of(mitm)
    assert len(rows) == 2
    for row in rows:
        assert row["status"] == "error" and "aborted the generation" in row["error"]
    assert "aborted the generation: Aborted" in rows[0]["error"]  # meta_info's message
