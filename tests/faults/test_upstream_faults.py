"""Upstream faults, each through a real mitmdump to the reference server, once per dialect: the
whole table through one proxy per dialect, so every fault must also leave it working for the next.

For every fault: what the harness receives (HTTP status, the dialect's error shape or the stream's
error event), what the record says (status, error, http_status, the tokens received before the
fault, exactly), and that the next call on the same proxy works.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.helpers.procs import free_port, start_policy_server
from tests.helpers.upstreams import direct_ids

from .conftest import SCENARIO, arm, reset_server, server_stats
from .dialects import dialect_rows, row_id
from .harness import Harness, live_records, marker, record_of, records

TIMEOUT = 2  # polar_upstream_timeout for these proxies: a stall is any silence beyond it


@dataclass(frozen=True)
class UpstreamFault:
    id: str
    spec: dict
    stream: bool
    status: int  # what the harness gets; 200 with `kind` set = a stream that ended in an error
    kind: str | None  # the error's type in the dialect's shape; None = a normal reply
    says: tuple[str, ...] = ()  # in the harness's error message and the record's error
    tokens: int | None = 0  # output ids the record keeps; None = all of them, -k = all but k
    prompt_ids: bool = False  # the record has the prompt ids (the first chunk arrived)
    record_status: str = "error"
    flags: tuple[str, ...] = ()
    retry_after: str | None = None
    all_logprobs: bool = False  # the server still sent every logprob (it ignored only the ids)


def _sent_before(after: int) -> int:
    """Output tokens in stream events 0..after-1: event 0 is the role chunk, then one per event."""
    return after - 1


UPSTREAM_FAULTS = [
    # HTTP errors before any byte: the status is passed on, in the dialect's shape.
    UpstreamFault("503-body-json", {"mode": "http_error", "status": 503}, False, 503,
                  "server_error", ("HTTP 503", "injected fault: HTTP 503")),
    UpstreamFault("503-body-stream", {"mode": "http_error", "status": 503}, True, 503,
                  "server_error", ("HTTP 503", "injected fault: HTTP 503")),
    UpstreamFault("500-nobody-json", {"mode": "http_error", "status": 500, "body": "none"}, False,
                  500, "server_error", ("returned HTTP 500",)),
    UpstreamFault("502-text-stream", {"mode": "http_error", "status": 502, "body": "Bad Gateway"},
                  True, 502, "server_error", ("returned HTTP 502: Bad Gateway",)),
    UpstreamFault("429-body-json", {"mode": "http_error", "status": 429, "retry_after": 7}, False,
                  429, "rate_limit_error", ("HTTP 429",), retry_after="7"),
    UpstreamFault("429-body-stream", {"mode": "http_error", "status": 429, "retry_after": 3}, True,
                  429, "rate_limit_error", ("HTTP 429",), retry_after="3"),
    UpstreamFault("429-nobody-stream", {"mode": "http_error", "status": 429, "body": "none"}, True,
                  429, "rate_limit_error", ("returned HTTP 429",)),
    # The connection reset: before the status line, half-way through a body, mid-stream.
    UpstreamFault("reset-before-json", {"mode": "reset", "after": 0}, False, 502, "server_error",
                  ("closed the connection",)),
    UpstreamFault("reset-before-stream", {"mode": "reset", "after": 0}, True, 502, "server_error",
                  ("closed the connection",)),
    UpstreamFault("reset-mid-body-json", {"mode": "reset", "after": 1}, False, 502, "server_error",
                  ("closed the connection",)),
    UpstreamFault("reset-mid-stream", {"mode": "reset", "after": 5}, True, 200, "server_error",
                  ("closed the connection",), tokens=_sent_before(5), prompt_ids=True),
    # Silence beyond polar_upstream_timeout.
    UpstreamFault("stall-before-json", {"mode": "stall", "after": 0, "seconds": 30}, False, 504,
                  "server_error", (f"sent nothing for {TIMEOUT}s before replying",)),
    UpstreamFault("stall-before-stream", {"mode": "stall", "after": 0, "seconds": 30}, True, 504,
                  "server_error", (f"sent nothing for {TIMEOUT}s before replying",)),
    UpstreamFault("stall-mid-stream", {"mode": "stall", "after": 4, "seconds": 30}, True, 200,
                  "server_error", (f"sent nothing for {TIMEOUT}s mid-stream",),
                  tokens=_sent_before(4), prompt_ids=True),
    # A stream that ends cleanly but early, a broken chunk, vLLM's error event.
    UpstreamFault("truncated-stream", {"mode": "truncate", "after": 4}, True, 200, "server_error",
                  ("ended the stream before it was complete",), tokens=_sent_before(4),
                  prompt_ids=True),
    UpstreamFault("truncated-json", {"mode": "truncate"}, False, 502, "server_error",
                  ("not valid JSON",)),
    UpstreamFault("bad-json-chunk", {"mode": "bad_json", "at": 4}, True, 200, "server_error",
                  ("invalid JSON in a stream chunk",), tokens=_sent_before(4), prompt_ids=True),
    UpstreamFault("bad-json-body", {"mode": "bad_json"}, False, 502, "server_error",
                  ("not valid JSON",)),
    UpstreamFault("error-event", {"mode": "error_event", "after": 3}, True, 200, "server_error",
                  ("upstream error mid-stream", "the engine failed"), tokens=_sent_before(3),
                  prompt_ids=True),
    # The server ignored the token flags: the harness is served, the record says what is missing.
    UpstreamFault("no-token-ids-stream", {"mode": "drop_token_ids"}, True, 200, None,
                  tokens=0, record_status="completed", flags=("missing_token_ids",),
                  all_logprobs=True),
    UpstreamFault("no-token-ids-json", {"mode": "drop_token_ids"}, False, 200, None,
                  tokens=0, record_status="completed", flags=("missing_token_ids",),
                  all_logprobs=True),
    UpstreamFault("no-usage-stream", {"mode": "drop_usage"}, True, 200, None, tokens=None,
                  prompt_ids=True, record_status="completed"),
    # Sampled ids lost on the way (a vLLM bug once dropped tool-call tokens from streams): usage
    # still counts them, the record is flagged and not trainable.
    UpstreamFault("lost-token-ids-stream", {"mode": "lose_token_ids", "count": 2}, True, 200,
                  None, tokens=-2, prompt_ids=True, record_status="completed",
                  flags=("count_mismatch",), all_logprobs=True),
    UpstreamFault("lost-token-ids-json", {"mode": "lose_token_ids"}, False, 200, None,
                  tokens=-1, prompt_ids=True, record_status="completed",
                  flags=("count_mismatch",), all_logprobs=True),
]  # fmt: skip


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
@pytest.mark.parametrize("fault", UPSTREAM_FAULTS, ids=lambda f: f.id)
def test_upstream_fault(row, fault, fault_server, shared_mitm, ledger, secret_book):
    reset_server(fault_server)
    mitm = shared_mitm(row.name, polar_upstream_timeout=TIMEOUT)
    text, after = marker(fault.id), marker("next")
    truth = direct_ids(fault_server.url, "vllm", [{"role": "user", "content": text}])
    full_text = truth.reply["choices"][0]["message"]["content"]
    arm(fault_server, text, fault.spec)
    with (
        ledger.fault(f"{row.name}:{fault.id}"),
        Harness(mitm, row, api_key=secret_book.new("sk-fault")) as harness,
    ):
        got = harness.call(text, fault.stream)
        assert got.status == fault.status, got
        if fault.kind is None:
            assert got.done and got.error is None and got.text.strip() == full_text.strip()
        else:
            assert got.error is not None and not got.done, got
            assert got.error.type == row.kind(fault.kind, got.status), got.error
            for words in fault.says:
                assert words in got.error.message, got.error
            assert full_text.strip().startswith(got.text.strip())
        if fault.retry_after is not None:
            assert got.headers.get("retry-after") == fault.retry_after

        nxt = harness.call(after, fault.stream)
        assert nxt.status == 200 and nxt.done and nxt.error is None, nxt
        rows = live_records(mitm, [text, after])
        ledger.account(rows, [text, after])

        rec = record_of(rows, text)
        assert rec["status"] == fault.record_status, rec["error"]
        assert rec["http_status"] == fault.status
        for words in fault.says:
            assert words in rec["error"], rec["error"]
        if fault.kind is None:
            assert rec["error"] is None
        n = len(truth.output_ids) if fault.tokens is None else fault.tokens
        if n < 0:  # all but the last -n
            n += len(truth.output_ids)
        assert rec["output_token_ids"] == truth.output_ids[:n]
        lps = truth.logprobs if fault.all_logprobs else truth.logprobs[:n]
        assert rec["output_logprobs"] == pytest.approx(lps, abs=1e-6)
        assert rec["prompt_token_ids"] == (truth.prompt_ids if fault.prompt_ids else None)
        for flag in fault.flags:
            assert flag in rec["fidelity_flags"]
        assert rec["trainable"] is (fault.record_status == "completed" and not fault.flags)
        if fault.id == "no-usage-stream":
            assert rec["count_check"] == "no_usage"
        if fault.spec["mode"] == "lose_token_ids":
            assert rec["count_check"] == "mismatch"
            assert rec["usage_completion_tokens"] == len(truth.output_ids)

        nrec = record_of(rows, after)
        assert nrec["status"] == "completed" and nrec["trainable"] is True
        assert nrec["output_token_ids"] and nrec["prompt_token_ids"]
        if fault.spec["mode"] == "stall":  # the proxy gave up on the upstream: it hung up
            assert server_stats(fault_server).get("client_gone", 0) == 1


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_connection_refused_then_the_server_comes_up(row, make_mitm, tmp_path, ledger, secret_book):
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    mitm = make_mitm(dead)
    texts = [marker("refused-json"), marker("refused-stream"), marker("up")]
    with (
        ledger.fault(f"{row.name}:connection-refused"),
        Harness(mitm, row, api_key=secret_book.new("sk-refused")) as harness,
    ):
        for text, stream in zip(texts[:2], (False, True), strict=True):
            got = harness.call(text, stream)
            assert got.status == 502 and got.error.type == row.kind("server_error", 502), got
            assert dead in got.error.message and "unreachable" in got.error.message
        server = start_policy_server(tmp_path, SCENARIO, ["--port", str(port)], name="late")
        try:
            got = harness.call(texts[2], True)
            assert got.status == 200 and got.done and got.text, got
        finally:
            server.stop()
        rows = records(mitm)
        ledger.account(rows, texts)
        for text in texts[:2]:
            rec = record_of(rows, text)
            assert rec["status"] == "error" and rec["http_status"] == 502
            assert dead in rec["error"] and rec["prompt_token_ids"] is None
        rec = record_of(rows, texts[2])
        assert rec["status"] == "completed" and rec["trainable"] is True


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_wrong_model_name(row, fault_server, make_mitm, ledger, secret_book):
    """polar_model names a model the server does not serve: vLLM's 404, in the harness's shape,
    naming the model; the record says which model was sent."""
    mitm = make_mitm(fault_server.url, polar_model="no-such-model")
    text, after = marker("wrong-model"), marker("wrong-model-again")
    with (
        ledger.fault(f"{row.name}:wrong-model"),
        Harness(mitm, row, api_key=secret_book.new("sk-model")) as harness,
    ):
        got = harness.call(text, True)
        assert got.status == 404 and got.error.type == row.kind("invalid_request_error", 404), got
        assert "no-such-model" in got.error.message and "does not exist" in got.error.message
        # the proxy keeps serving: a non-streaming call gets the same answer, and its record
        nxt = harness.call(after, False)
        assert nxt.status == 404 and nxt.error.type == row.kind("invalid_request_error", 404), nxt
        rows = records(mitm)
        ledger.account(rows, [text, after])
        for t in (text, after):
            rec = record_of(rows, t)
            assert rec["status"] == "error" and rec["http_status"] == 404
            assert rec["model_served"] == "no-such-model" and "no-such-model" in rec["error"]


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_model_renamed_under_the_proxy(row, make_mitm, tmp_path, ledger, secret_book):
    """Without polar_model the proxy serves the first model the server lists. When the server is
    redeployed under another name, the call that still names the old one gets the 404, and the
    proxy asks again: the next call works."""
    port = free_port()
    old = start_policy_server(tmp_path, SCENARIO, ["--port", str(port), "--model", "m-old"], "old")
    mitm = make_mitm(old.url)
    texts = [marker("old"), marker("gone"), marker("new")]
    with (
        ledger.fault(f"{row.name}:model-renamed"),
        Harness(mitm, row, api_key=secret_book.new("sk-rename")) as harness,
    ):
        assert harness.call(texts[0], False).done
        old.stop()
        new = start_policy_server(tmp_path, SCENARIO, ["--port", str(port), "--model", "m-new"],
                                  "new")  # fmt: skip
        try:
            got = harness.call(texts[1], False)
            assert got.status == 404 and "m-old" in got.error.message, got
            got = harness.call(texts[2], False)
            assert got.status == 200 and got.done, got
        finally:
            new.stop()
        rows = records(mitm)
        ledger.account(rows, texts)
        served = [(record_of(rows, t)["status"], record_of(rows, t)["model_served"]) for t in texts]
        assert served == [("completed", "m-old"), ("error", "m-old"), ("completed", "m-new")]
