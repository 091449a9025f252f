"""A harness as the fault suite drives it: real HTTPS through the proxy, read the way SDKs read.

`Harness.call` returns what the harness got (status, error in the dialect's shape, text, whether
the stream ended well); `records` reads what the proxy wrote; `Ledger` is the suite's tally for the
one summary line (faults injected / survived, fuzz cases / crashes, calls / lost, secrets on disk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets as _secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx

from polar_mitm.store import read_table
from tests.helpers.procs import Mitm
from tests.helpers.waits import SLOW_MACHINE, wait_until

from .dialects import DialectRow, ErrorShape, StreamResult


@dataclass
class Outcome:
    status: int
    headers: httpx.Headers
    error: ErrorShape | None = None
    text: str = ""
    reply_id: str | None = None
    done: bool = False  # a complete reply (non-streaming 200, or a stream that ended normally)
    stream: StreamResult | None = None


class SSEReader:
    """The `data:` payloads of a stream fed in pieces (written here, independent of
    polar_mitm.core.sse; the proxy writes `\\n` line ends, `\\r\\n` in Google's dialect). Resumes
    its search where it stopped, so a 64 MB event arriving in 64 KB pieces costs one pass, not a
    thousand."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self._scanned = 0

    def feed(self, data: bytes) -> list[str]:
        self.buffer += data.replace(b"\r", b"")  # no payload holds a raw CR: JSON escapes it
        out = []
        while (end := self.buffer.find(b"\n\n", max(self._scanned - 1, 0))) >= 0:
            block = bytes(self.buffer[:end]).decode("utf-8")
            del self.buffer[: end + 2]
            self._scanned = 0
            data_lines = [ln[5:].lstrip(" ") for ln in block.split("\n") if ln.startswith("data:")]
            if data_lines:
                out.append("\n".join(data_lines))
        self._scanned = len(self.buffer)
        return out


def sse_payloads(raw: bytes | bytearray) -> list[str]:
    """The `data:` payloads of a whole stream."""
    reader = SSEReader()
    payloads = reader.feed(bytes(raw))
    assert not reader.buffer.strip(), (
        f"stream ended inside an event: {bytes(reader.buffer)[-300:]!r}"
    )
    return payloads


class Harness:
    """One harness process: its own connection(s) through the proxy, its own credentials."""

    def __init__(
        self,
        mitm: Mitm,
        row: DialectRow,
        api_key: str | None = None,
        proxy_user: str | None = None,
        proxy_password: str = "pw",
        timeout: float = 60.0,
    ) -> None:
        self.row = row
        self.api_key = api_key
        self.client = httpx.Client(
            proxy=mitm.proxy(proxy_user, proxy_password), verify=str(mitm.ca), timeout=timeout
        )

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(
        self,
        text: str,
        stream: bool,
        on_payload: Callable[[int], None] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        **extra: Any,
    ) -> Outcome:
        """One LLM call. `on_payload(n)` runs after the n-th stream event arrived (handshakes);
        `params` are added to the query (which the dialect's URL may already have)."""
        body = json.dumps(self.row.body(text, stream, **extra)).encode()
        hdrs = {"content-type": "application/json", **self.row.headers(self.api_key)}
        hdrs.update(headers or {})
        url = self.row.url_for(stream)
        if params:
            url += ("&" if "?" in url else "?") + urlencode(params)
        with self.client.stream("POST", url, content=body, headers=hdrs) as r:
            if r.status_code != 200 or not stream:
                r.read()
                payload = r.json()
                if r.status_code != 200:
                    return Outcome(r.status_code, r.headers, error=self.row.error(payload))
                text_out, reply_id = self.row.reply(payload)
                return Outcome(200, r.headers, text=text_out, reply_id=reply_id, done=True)
            assert r.headers["content-type"].startswith("text/event-stream"), r.headers
            reader, payloads = SSEReader(), []
            for data in r.iter_raw():
                for payload in reader.feed(data):
                    payloads.append(payload)
                    if on_payload is not None:
                        on_payload(len(payloads))
            assert not reader.buffer.strip(), f"stream ended inside an event: {reader.buffer!r}"
        result = self.row.stream(payloads)
        assert result.done or result.error, f"stream ended without its end or error: {payloads}"
        return Outcome(
            200,
            r.headers,
            error=result.error,
            text=result.text,
            reply_id=result.reply_id,
            done=result.done,
            stream=result,
        )


def marker(tag: str) -> str:
    """A unique first user message: the key an armed fault and a record are found by."""
    return f"[{tag}-{_secrets.token_hex(6)}] please count"


def records(mitm: Mitm) -> list[dict[str, Any]]:
    """Stop the proxy (its shards are written at shutdown) and read every calls row."""
    assert mitm.stop() == 0, mitm.proc.output()[-4000:]
    rows = read_table(str(mitm.output), "calls").to_pylist()
    return sorted(rows, key=lambda r: r["started_at"])


def live_records(
    mitm: Mitm, texts: list[str], timeout: float = SLOW_MACHINE
) -> list[dict[str, Any]]:
    """The calls rows of a running proxy once every one of `texts` has its record (a proxy
    started with polar_flush_rows=1 writes each record as a shard of its own)."""
    needles = [json.dumps(t)[1:-1] for t in texts]

    def complete() -> list[dict[str, Any]]:
        rows = read_table(str(mitm.output), "calls").to_pylist()
        blob = [r["request_json"] or "" for r in rows]
        return rows if all(any(n in b for b in blob) for n in needles) else []

    rows = wait_until(complete, f"the records of {texts}", timeout)
    return sorted(rows, key=lambda r: r["started_at"])


def record_of(rows: list[dict[str, Any]], text: str) -> dict[str, Any]:
    """The one record whose request holds `text` as its user message."""
    needle = json.dumps(text)[1:-1]
    found = [r for r in rows if r["request_json"] and needle in r["request_json"]]
    assert len(found) == 1, f"{len(found)} records for {text!r}"
    return found[0]


@dataclass
class Ledger:
    """The suite's figures, printed as one line at the end (`pytest_terminal_summary`)."""

    faults_injected: int = 0
    faults_survived: int = 0
    fuzz_cases: int = 0
    fuzz_crashes: int = 0
    calls: int = 0
    lost: int = 0
    secrets_found: int | None = None  # set by the session-end grep
    failed_faults: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def fault(self, name: str) -> Iterator[None]:
        """Count a fault as injected, and as survived only if every check in the block passed."""
        self.faults_injected += 1
        try:
            yield
        except BaseException:
            self.failed_faults.append(name)
            raise
        self.faults_survived += 1

    def account(self, rows: list[dict[str, Any]], texts: list[str]) -> None:
        """Every call made (by its user message) must have exactly one record."""
        self.calls += len(texts)
        blob = [r["request_json"] or "" for r in rows]
        for text in texts:
            needle = json.dumps(text)[1:-1]
            if sum(needle in b for b in blob) != 1:
                self.lost += 1

    def merge(self, other: Ledger) -> None:
        """Add another process's figures (a pytest-xdist worker's)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "secrets_found":
                if theirs is not None:
                    self.secrets_found = (mine or 0) + theirs
            else:
                setattr(self, f.name, mine + theirs)

    def line(self) -> str:
        secrets = "not checked" if self.secrets_found is None else str(self.secrets_found)
        return (
            f"polar-mitm faults: {self.faults_survived}/{self.faults_injected} faults survived, "
            f"{self.fuzz_cases} fuzz cases / {self.fuzz_crashes} crashes, "
            f"{self.calls} calls / {self.lost} lost, {secrets} secrets found on disk"
        )
