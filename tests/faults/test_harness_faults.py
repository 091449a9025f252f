"""Harness faults: a client that hangs up mid-stream or gives up early, a slow reader, a huge
prompt, and many rollouts at once. Each through a real mitmdump, once per dialect."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.upstreams import direct_ids
from tests.helpers.waits import wait_until

from .conftest import arm, reset_server, server_stats
from .dialects import DialectRow, dialect_rows, row_id
from .harness import Harness, marker, record_of, records, sse_payloads

CONCURRENT_ROLLOUTS = 64
CONCURRENT_SECONDS = float(os.environ.get("POLAR_FAULTS_CONCURRENCY_S", "10"))


class Hangup(Exception):
    """Raised from a stream callback: the harness closes its connection there."""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_client_hangs_up_mid_stream(row, fault_server, make_mitm, ledger, secret_book):
    """The harness closes the connection on the last event the upstream's first chunks make (the
    role chunk and four tokens; more where the dialect shows the first ones as no event) while the
    upstream is still generating:
    the proxy cancels the upstream request (the server sees its connection closed), the record
    is client_aborted with exactly the tokens received so far, and the next call works."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url)
    text, after = marker("hangup"), marker("next")
    truth = direct_ids(fault_server.url, "vllm", [{"role": "user", "content": text}])
    stall = row.stall_after_chunks
    arm(fault_server, text, {"mode": "stall", "after": stall, "seconds": 60})

    def hang_up(n: int) -> None:
        if n == row.events_before_stall:
            raise Hangup

    with (
        ledger.fault(f"{row.name}:client-hangs-up"),
        Harness(mitm, row, api_key=secret_book.new("sk-hangup")) as harness,
    ):
        with pytest.raises(Hangup):
            harness.call(text, True, on_payload=hang_up)
        wait_until(lambda: server_stats(fault_server).get("client_gone") == 1, "the hang-up")
        nxt = harness.call(after, True)
        assert nxt.status == 200 and nxt.done, nxt
        rows = records(mitm)
        ledger.account(rows, [text, after])
        rec = record_of(rows, text)
        assert rec["status"] == "client_aborted", rec
        assert "harness" in rec["error"] and rec["trainable"] is False
        assert rec["prompt_token_ids"] == truth.prompt_ids
        assert rec["output_token_ids"] == truth.output_ids[: stall - 1]  # all but the role chunk
        assert record_of(rows, after)["status"] == "completed"


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_client_gives_up_before_the_reply(row, fault_server, make_mitm, ledger, secret_book):
    """The upstream is silent and the harness's own read timeout fires first: the proxy cancels
    the upstream request and records client_aborted, no tokens."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url)
    text, after = marker("gives-up"), marker("next")
    arm(fault_server, text, {"mode": "stall", "after": 0, "seconds": 60})
    key = secret_book.new("sk-giveup")
    with ledger.fault(f"{row.name}:client-gives-up"):
        with (
            Harness(mitm, row, api_key=key, timeout=1.0) as harness,
            pytest.raises(httpx.ReadTimeout),
        ):
            harness.call(text, False)
        wait_until(lambda: server_stats(fault_server).get("client_gone") == 1, "the cancel")
        with Harness(mitm, row, api_key=key) as harness:  # the proxy serves the next call
            nxt = harness.call(after, True)
            assert nxt.status == 200 and nxt.done and nxt.error is None, nxt
        rows = records(mitm)
        ledger.account(rows, [text, after])
        rec = record_of(rows, text)
        assert rec["status"] == "client_aborted" and rec["output_token_ids"] == []
        assert rec["prompt_token_ids"] is None and rec["trainable"] is False
        assert "harness" in rec["error"], rec["error"]
        assert record_of(rows, after)["status"] == "completed"


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_slow_reader_gets_back_pressure(row, fault_server, make_mitm, ledger, secret_book):
    """A fast upstream floods 64 MB while the harness stops reading: the proxy must stop reading
    the upstream too (its memory stays bounded, the server cannot finish), then deliver it all."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url)
    chunks, size = 4000, 16 << 10
    total = chunks * size
    text, after = marker("flood"), marker("next")
    arm(fault_server, text, {"mode": "flood", "chunks": chunks, "bytes": size})
    pid = mitm.proc.popen.pid
    seen: dict[str, int] = {}

    def pause(n: int) -> None:
        if n != 20:
            return
        seen["rss_before"] = rss_bytes(pid)
        peak, sent = 0, []
        for _ in range(16):  # 4 s without reading a byte, sampling the proxy and the server
            time.sleep(0.25)
            peak = max(peak, rss_bytes(pid))
            sent.append(server_stats(fault_server).get("bytes_sent", 0))
        seen["rss_peak"], seen["sent"] = peak, sent[-1]
        seen["completed"] = server_stats(fault_server).get("streams_completed", 0)
        seen["plateau"] = sent[-1] - sent[-5]  # bytes the server got out in the last second

    with (
        ledger.fault(f"{row.name}:slow-reader"),
        Harness(mitm, row, api_key=secret_book.new("sk-slow"), timeout=120) as harness,
    ):
        got = harness.call(text, True, on_payload=pause)
        assert got.status == 200 and got.done, got.error
        assert got.text == "x" * total
        growth = seen["rss_peak"] - seen["rss_before"]
        print(f"slow reader: server sent {seen['sent'] / 1e6:.1f} of {total / 1e6:.0f} MB while "
              f"the harness paused; proxy RSS grew {growth / 1e6:.1f} MB")  # fmt: skip
        assert seen["completed"] == 0, "the server finished: nothing held it back"
        assert seen["sent"] < total / 2 and seen["plateau"] < 2 * size
        assert growth < 0.4 * total, f"proxy RSS grew {growth / 1e6:.0f} MB"
        nxt = harness.call(after, True)
        assert nxt.status == 200 and nxt.done and nxt.error is None, nxt
        rows = records(mitm)
        ledger.account(rows, [text, after])
        rec = record_of(rows, text)
        assert rec["status"] == "completed" and len(rec["output_token_ids"]) == chunks + 1
        assert rec["count_check"] == "ok" and rec["error"] is None
        assert record_of(rows, after)["status"] == "completed"


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_huge_prompts(row, fault_server, make_mitm, ledger, secret_book):
    """A 20 MB prompt is accepted and captured whole; the server's verdict (beyond its context
    length) reaches the harness in its shape. Beyond polar_max_request_mb the proxy refuses it
    itself with a 413 in the dialect's shape, and records that too. The next call works."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url, polar_max_request_mb=32)
    big, bigger = marker("20mb"), marker("40mb")
    pad20, pad40 = "lorem ipsum " * (20_000_000 // 12), "dolor sit " * (40_000_000 // 10)
    after = marker("next")
    with (
        ledger.fault(f"{row.name}:huge-prompt"),
        Harness(mitm, row, api_key=secret_book.new("sk-huge"), timeout=120) as harness,
    ):
        got = harness.call(big + pad20, True)
        assert got.status == 400 and got.error.type == row.kind("invalid_request_error", 400), got
        assert "maximum context length" in got.error.message
        upstream = [r for r in httpx.get(fault_server.url + "/_polar/requests", timeout=60).json()
                    if r["path"] == "/v1/chat/completions"]  # fmt: skip
        assert upstream[-1]["body"]["messages"][0]["content"] == big + pad20
        got = harness.call(bigger + pad40, True)
        assert got.status == 413 and "polar_max_request_mb=32" in got.error.message, got
        assert harness.call(after, True).done
        rows = records(mitm)
        ledger.account(rows, [big + pad20, after])
        rec = record_of(rows, big + pad20)
        assert rec["status"] == "error" and rec["http_status"] == 400
        assert len(rec["request_json"]) > 20_000_000 and (big + pad20) in rec["request_json"]
        refused = [r for r in rows if r["http_status"] == 413]
        assert len(refused) == 1 and refused[0]["status"] == "error"
        ledger.calls += 1  # the refused call: found by its status (its body is kept truncated)
        assert record_of(rows, after)["status"] == "completed"


def _replay(text: str, prompt_ids: list[int], stream: bool) -> tuple[bytes, str]:
    """A valid vLLM reply (a stream or one body) that names the request it answers, so that
    cross-talk shows in what the harness reads and in the record."""
    reply = f"reply to {text}"
    words = reply.split(" ")
    n = len(words) + 1
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
             "total_tokens": len(prompt_ids) + n}  # fmt: skip
    head = {"id": "chatcmpl-" + os.urandom(8).hex(), "object": "chat.completion.chunk",
            "created": 1, "model": "Qwen/Qwen3-4B"}  # fmt: skip
    if not stream:
        message = {"role": "assistant", "content": reply}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop",
                  "token_ids": [100 + i for i in range(n - 1)] + [151645]}  # fmt: skip
        body = {**head, "object": "chat.completion", "choices": [choice], "usage": usage,
                "prompt_token_ids": prompt_ids}  # fmt: skip
        return json.dumps(body).encode(), reply

    def chunk(delta: dict, ids: list[int] | None, finish: str | None = None, **more) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            choice["token_ids"] = ids
        return b"data: " + json.dumps({**head, "choices": [choice], **more}).encode() + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""}, None, prompt_token_ids=prompt_ids)]
    for i, word in enumerate(words):
        out.append(chunk({"content": word if i == 0 else " " + word}, [100 + i]))
    out.append(chunk({}, [151645], "stop"))
    out.append(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out), reply


async def _rollout(
    i: int, mitm, row: DialectRow, server_url: str, deadline: float, key: str, log: list
) -> None:
    """One rollout: calls back to back until the deadline, each answered with its own reply."""
    rollout = f"grp{i // 8}.{i % 8}"
    by_proxy_auth = i % 2 == 0  # half name themselves in the proxy URL, half by API key
    proxy = mitm.proxy(rollout, key) if by_proxy_auth else mitm.url
    api_key = key if by_proxy_auth else f"polar-{rollout}"
    headers = {"content-type": "application/json", **row.headers(api_key)}
    k = 0
    async with (
        httpx.AsyncClient(proxy=proxy, verify=str(mitm.ca), timeout=60) as client,
        httpx.AsyncClient(timeout=30) as control,
    ):
        while time.monotonic() < deadline:
            text = f"[{rollout}#{k}] please count"
            prompt_ids = [1000 + i, k]
            stream = k % 2 == 0
            data, reply = _replay(text, prompt_ids, stream)
            r = await control.post(server_url + "/_polar/faults", json={
                "key": text, "fault": {"mode": "replay", "data": data.decode()}})  # fmt: skip
            r.raise_for_status()
            body = json.dumps(row.body(text, stream)).encode()
            url = row.url_for(stream)
            async with client.stream("POST", url, content=body, headers=headers) as resp:
                raw = await resp.aread()
            assert resp.status_code == 200, raw[:500]
            if stream:
                result = row.stream(sse_payloads(raw))
                got, done = result.text, result.done
            else:
                got, _ = row.reply(json.loads(raw))
                done = True
            log.append((rollout, text, prompt_ids, reply, got, done))
            k += 1


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_many_rollouts_at_once(row, fault_server, make_mitm, ledger, secret_book):
    """64 rollouts call concurrently for a bounded time; every harness gets its own reply and
    every record has the right rollout id (and group), the right prompt ids and reply."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url)
    key = secret_book.new("sk-many")
    log: list = []

    async def run() -> None:
        deadline = time.monotonic() + CONCURRENT_SECONDS
        await asyncio.gather(
            *(
                _rollout(i, mitm, row, fault_server.url, deadline, key, log)
                for i in range(CONCURRENT_ROLLOUTS)
            )
        )

    with ledger.fault(f"{row.name}:64-rollouts"):
        started = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - started
        print(f"{len(log)} calls from {CONCURRENT_ROLLOUTS} rollouts in {elapsed:.1f}s")
        assert len({entry[0] for entry in log}) == CONCURRENT_ROLLOUTS
        crossed = [e for e in log if e[4].strip() != e[3] or not e[5]]
        assert not crossed, crossed[:3]
        rows = records(mitm)
        ledger.account(rows, [e[1] for e in log])
        assert len(rows) == len(log)
        for rollout, text, prompt_ids, reply, _, _ in log:
            rec = record_of(rows, text)
            assert rec["rollout_id"] == rollout, (text, rec["rollout_id"])
            assert rec["group_id"] == rollout.split(".")[0]
            assert rec["sample_index"] == int(rollout.split(".")[1])
            assert rec["prompt_token_ids"] == prompt_ids
            assert json.loads(rec["response_json"])["choices"][0]["message"]["content"] == reply
            assert rec["status"] == "completed" and rec["count_check"] == "ok"
