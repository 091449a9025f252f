"""The fuzz: 10,000 cases per dialect — 5,000 harness request bodies and 5,000 upstream replies
(SSE streams and JSON bodies) — each through one real mitmdump (connections reused), with non-LLM
flows interleaved.

Every answer must be a 4xx in the dialect's error shape or a correct reply (a non-streaming body, or
a stream that ends the dialect's way or with its error event); upstream garbage must come back as
the dialect's error (502/504 or the upstream's status), never as a proxy internal error. Every LLM
call leaves exactly one record whose http_status is what the harness got; the proxy never crashes
or logs a traceback; other traffic passes byte for byte. POLAR_FUZZ_CASES changes the count.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers.tls_echo import start_tls_echo

from .dialects import DialectRow, dialect_rows, row_id
from .fuzzing import request_body, upstream_reply
from .harness import records, sse_payloads

# Cases per dialect, all through one real mitmdump each: half harness request bodies, half
# upstream replies (four in five shaped like vLLM's, one in five like SGLang's).
FUZZ_CASES = int(os.environ.get("POLAR_FUZZ_CASES", "10000"))
BODY_CASES = FUZZ_CASES // 2
# Cases go in batches over a few kept-alive connections at once, so that generating the next
# cases overlaps with the proxy's work: on 2 cores that is most of the speed.
BATCH, THREADS = 16, 4
# Room for a kept-alive tunnel per thread to each host: an evicted one costs a new CONNECT + TLS.
LIMITS = httpx.Limits(max_connections=4 * THREADS, max_keepalive_connections=4 * THREADS)
FUZZ_SETTINGS = settings(
    max_examples=-(-BODY_CASES // BATCH),
    deadline=None,
    database=None,
    derandomize=True,  # the same cases on every run: CI failures reproduce
    suppress_health_check=list(HealthCheck),
    # Shrinking a failing batch takes minutes: off in CI (the failure reproduces, derandomized);
    # POLAR_FUZZ_SHRINK=1 turns it on to get a minimal case.
    phases=[
        Phase.explicit,
        Phase.generate,
        *([Phase.shrink] * (os.environ.get("POLAR_FUZZ_SHRINK") == "1")),
    ],
)
_CRASH_MARKERS = ("Traceback", "internal error", "Addon error", "Error in")


def check_answer(row: DialectRow, r: httpx.Response, allow_5xx: bool) -> bool:
    """A well-formed answer in the dialect: a reply, a stream that ends, or its error shape.
    True for a complete reply."""
    if r.status_code == 200:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            result = row.stream(sse_payloads(r.content))
            assert result.done or result.error, r.content[-300:]
            if result.error is not None:
                assert "internal error" not in result.error.message, result.error
            return result.done
        row.reply(r.json())
        return True
    assert 400 <= r.status_code < (600 if allow_5xx else 500), (r.status_code, r.text[:500])
    error = row.error(r.json())
    assert "internal error" not in error.message, error
    return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc: what it cost, whatever the load)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_proxy_survived(mitm, statuses: list[int], ledger) -> list[dict]:
    assert mitm.proc.popen.poll() is None, "mitmdump died"
    cpu = cpu_seconds(mitm.proc.popen.pid)
    print(f"mitmdump CPU: {cpu:.1f}s, {cpu / len(statuses) * 1000:.2f} ms per case")
    log = mitm.proc.output()
    crashes = sum(log.count(m) for m in _CRASH_MARKERS)
    ledger.fuzz_crashes += crashes
    assert crashes == 0, log[-5000:]
    rows = records(mitm)
    ledger.calls += len(statuses)
    ledger.lost += max(0, len(statuses) - len(rows))
    assert len(rows) == len(statuses), "a call left no record (or two)"
    assert Counter(r["http_status"] for r in rows) == Counter(statuses)
    return rows


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_fuzz_request_bodies(row, fault_server, make_mitm, tmp_path, ledger, secret_book):
    echo = start_tls_echo(tmp_path)
    mitm = make_mitm(fault_server.url, ssl_insecure="true", flow_detail=0)
    key = secret_book.new("sk-fuzz")
    statuses: list[int] = []
    others = 0
    client = httpx.Client(proxy=mitm.url, verify=str(mitm.ca), timeout=60, limits=LIMITS)
    base_headers = {"content-type": "application/json", **row.headers(key)}

    def send(case: tuple[tuple[bytes, dict[str, str]], bytes | None]) -> int:
        (body, headers), other = case
        url = row.url_for(len(body) % 2 == 1)  # where the dialect streams at its own URL: both
        r = client.post(url, content=body, headers={**base_headers, **headers})
        check_answer(row, r, allow_5xx=False)
        if other is not None:  # a non-LLM flow between two calls: untouched, byte for byte
            echoed = client.post(f"https://127.0.0.1:{echo.port}/v1/chat/completions",
                                 content=other, headers=base_headers)  # fmt: skip
            assert echoed.status_code == 200 and echoed.content == other
            local = client.get(f"https://{row.host}/v1/files", headers=base_headers)
            assert local.status_code == 404 and "polar-mitm" in local.text
        return r.status_code

    # one case in 12 also sends a non-LLM flow (and one_of would fold repeated branches)
    other_flow = st.integers(0, 11).flatmap(
        lambda i: st.binary(max_size=2000) if i == 0 else st.none()
    )

    @FUZZ_SETTINGS
    @given(batch=st.lists(st.tuples(request_body(row), other_flow), min_size=BATCH, max_size=BATCH))
    def one(batch: list) -> None:
        nonlocal others
        ledger.fuzz_cases += len(batch)
        try:
            statuses.extend(pool.map(send, batch))
        except Exception:
            ledger.fuzz_crashes += 1
            raise
        others += sum(other is not None for _, other in batch)

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            one()
    finally:
        client.close()
        echo.stop()
    elapsed = time.monotonic() - started
    print(f"{row.name}: {len(statuses)} bodies ({others} with other flows) in {elapsed:.0f}s, "
          f"{len(statuses) / elapsed:.0f}/s; statuses {dict(Counter(statuses))}")  # fmt: skip
    assert len(statuses) >= BODY_CASES
    assert len(echo.seen_paths) == others
    rows = check_proxy_survived(mitm, statuses, ledger)
    assert all(r["status"] in ("completed", "error") for r in rows)


# The SGLang upstream module reads other fields (per-choice ids, meta_info triples).
UPSTREAMS = [("vllm", FUZZ_CASES * 2 // 5), ("sglang", max(FUZZ_CASES // 10, BATCH))]


@pytest.mark.parametrize("row", [r for r in dialect_rows() if r.odd_urls], ids=row_id)
def test_odd_urls_get_the_dialects_answer(row, fault_server, make_mitm, ledger, secret_book):
    """The other URLs of a dialect's endpoint (a stream asked without `alt=sse`, another encoding,
    another API version or method): each answered in the dialect's shape, nothing crashes."""
    mitm = make_mitm(fault_server.url, flow_detail=0)
    headers = {"content-type": "application/json", **row.headers(secret_book.new("sk-odd"))}
    with (
        ledger.fault(f"{row.name}:odd-urls"),
        httpx.Client(proxy=mitm.url, verify=str(mitm.ca), timeout=60) as client,
    ):
        for url, status in row.odd_urls:
            r = client.post(url, json=row.body("[odd-url] please count", False), headers=headers)
            assert r.status_code == status, (url, r.status_code, r.text[:500])
            if status == 200 and "totalTokens" in r.json():  # a token count, not a reply
                assert isinstance(r.json()["totalTokens"], int) and r.json()["totalTokens"] > 0
            else:
                check_answer(row, r, allow_5xx=False)
        log = mitm.proc.output()
        assert not any(m in log for m in _CRASH_MARKERS), log[-5000:]


@pytest.mark.parametrize(("upstream", "cases"), UPSTREAMS, ids=[u for u, _ in UPSTREAMS])
@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_fuzz_upstream_replies(row, upstream, cases, fault_server, make_mitm, ledger, secret_book):
    mitm = make_mitm(
        fault_server.url, flow_detail=0, polar_upstream_timeout=10, polar_upstream_kind=upstream
    )
    key = secret_book.new("sk-fuzz-up")
    statuses: list[int] = []
    client = httpx.Client(proxy=mitm.url, verify=str(mitm.ca), timeout=60, limits=LIMITS)
    control = httpx.Client(base_url=fault_server.url, timeout=30, limits=LIMITS)
    headers = {"content-type": "application/json", **row.headers(key)}
    replies = st.booleans().flatmap(lambda s: st.tuples(st.just(s), upstream_reply(s, upstream)))
    counter = itertools.count()
    valid = [0]  # cases whose replay was a valid reply

    def send(case: tuple[bool, dict]) -> int:
        stream, fault = case
        text = f"[fuzz-up-{next(counter)}] count"
        control.post("/_polar/faults", json={"key": text, "fault": fault}).raise_for_status()
        r = client.post(row.url_for(stream), json=row.body(text, stream), headers=headers)
        complete = check_answer(row, r, allow_5xx=True)
        if fault["valid"]:
            assert complete, r.content[-500:]
            valid[0] += 1
        return r.status_code

    @settings(FUZZ_SETTINGS, max_examples=-(-cases // BATCH))
    @given(batch=st.lists(replies, min_size=BATCH, max_size=BATCH))
    def one(batch: list) -> None:
        ledger.fuzz_cases += len(batch)
        try:
            statuses.extend(pool.map(send, batch))
        except Exception:
            ledger.fuzz_crashes += 1
            raise

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            one()
    finally:
        client.close()
        control.close()
    elapsed = time.monotonic() - started
    print(f"{row.name}: {len(statuses)} {upstream} replies in {elapsed:.0f}s, "
          f"{len(statuses) / elapsed:.0f}/s; statuses {dict(Counter(statuses))}")  # fmt: skip
    assert len(statuses) >= cases and valid[0] > cases // 40
    rows = check_proxy_survived(mitm, statuses, ledger)
    by_status = Counter((r["http_status"] == 200, r["status"]) for r in rows)
    assert set(by_status) <= {(True, "completed"), (True, "error"), (False, "error")}, by_status
    assert by_status[(True, "completed")] >= valid[0]
