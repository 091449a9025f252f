"""Incremental server-sent events: parse a byte stream cut at arbitrary points, write events.

Upstream servers and mitmproxy hand us bytes in whatever pieces the network produced, so an
event (or a `\\r\\n` pair) may be split across reads. The parser keeps the unfinished tail and
only returns whole events. It is on the hot path (one call per upstream read), so the common
case — `\\n` line endings, one `data:` line per event — avoids per-line work.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

from . import fastjson


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None


class SSEParser:
    """Feed bytes, get complete events. Follows the WHATWG event-stream rules.

    A long call's first event is hundreds of KB (vLLM's prompt ids) and arrives in many reads:
    each feed searches only the bytes not searched before, and an event's text is decoded
    straight out of the buffer, so the event costs one copy, not one per read."""

    __slots__ = ("_buf", "_skip_lf", "_scan", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 256 << 20) -> None:
        self._buf = bytearray()
        self._skip_lf = False
        self._scan = 0  # where the search for the next "\n\n" resumes
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[SSEEvent]:
        if self._skip_lf and data:
            # The last read ended in "\r", already taken as a line end: a "\n" now is its other half.
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buf = self._buf
        if b"\r" in data:
            self._skip_lf = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf += data
        events: list[SSEEvent] = []
        start = 0
        end = buf.find(b"\n\n", self._scan)
        if end >= 0:
            with memoryview(buf) as view:
                while end >= 0:
                    event = _parse_block(buf, view, start, end)
                    if event is not None:
                        events.append(event)
                    start = end + 2
                    end = buf.find(b"\n\n", start)
            del buf[:start]
        self._scan = max(len(buf) - 1, 0)
        if len(buf) > self.max_event_bytes:
            raise ValueError(f"SSE event larger than {self.max_event_bytes} bytes")
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: a final event without its blank line is dropped, as the spec says."""
        self._buf.clear()
        self._scan = 0
        return []

    @property
    def pending(self) -> int:
        return len(self._buf)


def _parse_block(buf: bytearray, view: memoryview, start: int, end: int) -> SSEEvent | None:
    """The event in ``buf[start:end]`` (``view`` is ``buf``'s)."""
    if buf.startswith(b"data: ", start) and buf.find(b"\n", start, end) < 0:  # the common case
        return SSEEvent(codecs.utf_8_decode(view[start + 6 : end], "replace", True)[0])
    text = codecs.utf_8_decode(view[start:end], "replace", True)[0]
    data: list[str] = []
    event = ident = None
    for line in text.split("\n"):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            ident = value
    if not data and event is None:
        return None
    return SSEEvent("\n".join(data), event, ident)


def encode(data: str, event: str | None = None) -> bytes:
    """One SSE event. `data` must not contain newlines (JSON from json.dumps never does)."""
    if event is None:
        return b"data: " + data.encode() + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data.encode() + b"\n\n"


def encode_json(obj: Any, event: str | None = None) -> bytes:
    return encode(dumps(obj), event)


def dumps(obj: Any) -> str:
    """Compact JSON, non-ASCII kept as is (what the servers and SDKs send): msgspec, a third of
    the stdlib encoder's time for a stream chunk (`fastjson`)."""
    return fastjson.dumps(obj)
