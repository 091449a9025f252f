"""The in-process endpoint mitmproxy forwards captured calls to.

mitmproxy's own upstream handling answers a refused connection with an HTML 502 and a reset
mid-stream with a closed socket; a harness needs its own dialect's error instead. So the addon
points each captured flow at this loopback server, which runs the `Call` — the upstream request,
token capture, translation — and streams the harness's reply back through mitmproxy with
`flow.response.stream` set, chunk by chunk. The harness's request body never crosses the
loopback: the call is looked up by the id in the path.

Its only client is mitmproxy, sending ``POST /polar-call/<id>`` with no body, one request at a
time per connection, so the server is a small asyncio protocol rather than a web framework: a
reply chunk is one `transport.write`, with no per-chunk coroutine, and a call's start is one
write of the status line and headers.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections.abc import Mapping

import aiohttp
from mitmproxy.http import Headers, HTTPFlow

from .exchange import Call, ClientGone

log = logging.getLogger(__name__)
PATH_PREFIX = "/polar-call/"
_MAX_HEAD = 64 << 10  # mitmproxy's request head is a few hundred bytes
_CLOSE_TIMEOUT_S = 2.0
_LAST_CHUNK = b"0\r\n\r\n"  # the end of a chunked body


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


def _head(status: int, headers: Mapping[str, str]) -> bytes:
    lines = [_status_line(status)]
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    lines.append(b"\r\n")
    return b"".join(lines)


def _whole(status: int, body: bytes, headers: Mapping[str, str]) -> bytes:
    """A response with its whole body (errors, non-streaming replies)."""
    return _head(status, {**headers, "Content-Length": str(len(body))}) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Connection(asyncio.Protocol):
    """One connection from mitmproxy: read a request head, run its call, answer, repeat."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.serving: asyncio.Task | None = None
        self.closed = False
        self._writable: asyncio.Future[None] | None = None  # set while the transport is paused

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.gateway.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.serving is None:
            self._next_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.gateway.connections.discard(self)
        self._wake()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._wake()

    # -- requests ----------------------------------------------------------------------------

    def _next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                self._refuse(431, "request head too large")
            return
        head = bytes(self.buffer[:end]).decode("latin-1")
        del self.buffer[: end + 4]
        request_line, _, header_lines = head.partition("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._refuse(400, "not an HTTP/1 request")
            return
        for line in header_lines.split("\r\n"):
            name, _, value = line.partition(":")
            name = name.strip().lower()
            body = name == "content-length" and value.strip() != "0"
            if body or name == "transfer-encoding":  # the addon never sends a body here
                self._refuse(400, "the gateway takes no request body")
                return
        target = parts[1]
        call_id = target[len(PATH_PREFIX) :] if target.startswith(PATH_PREFIX) else ""
        call = self.gateway.calls.pop(call_id, None)
        self.serving = asyncio.get_running_loop().create_task(self._serve(call))

    async def _serve(self, call: Call | None) -> None:
        out = _Output(self)
        try:
            if call is None or self.gateway.session is None:
                await out.send(404, b'{"error":{"message":"unknown call"}}')
            else:
                await call.run(out, self.gateway.session)
            if out.full is not None:  # set by send(): written once run() has returned
                self._write(out.full)
            elif out.started:
                if not out.ended:  # a failure's error event was the last: end the body
                    self._write(_LAST_CHUNK)
            else:  # cannot happen: every path of run() answers
                assert call is not None
                log.error("polar-mitm: call %s produced no response", call.record.call_id)
                body = b'{"error":{"message":"no response"}}'
                self._write(_whole(500, body, {"Content-Type": "application/json"}))
        except ClientGone:
            pass
        except BaseException:
            # Cancelled (the harness left, or shutdown) or a bug: the reply is cut short, so
            # the connection cannot carry another one.
            self._close()
            raise
        finally:
            self.serving = None
        if self.buffer and not self.closed:
            self._next_request()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message}}).encode()
        headers = {"Content-Type": "application/json", "Connection": "close"}
        try:
            self._write(_whole(status, body, headers))
        except ClientGone:
            pass
        self._close()

    # -- writing -----------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Write, or raise `ClientGone` once mitmproxy has closed the connection."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ClientGone()
        self.transport.write(data)

    async def drained(self) -> None:
        """Wait while the transport's buffer is over its high-water mark."""
        while self._writable is not None and not self.closed:
            await self._writable
        if self.closed:
            raise ClientGone()

    def _wake(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Output:
    """`exchange.Output` over a gateway connection: chunked transfer encoding, written as the
    call produces it; `send` keeps a whole response until the call has returned."""

    __slots__ = ("conn", "started", "ended", "full")

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.started = False
        self.ended = False
        self.full: bytes | None = None

    async def start(self, status: int, content_type: str) -> None:
        head = _head(
            status,
            {
                "Content-Type": content_type,
                "Cache-Control": "no-cache",
                "Transfer-Encoding": "chunked",
            },
        )
        self.started = True
        self.conn._write(head)

    async def write(self, data: bytes) -> None:
        conn = self.conn
        if data:
            conn._write(_chunk(data))
            if conn._writable is not None:  # mitmproxy reads slower than we write: wait
                await conn.drained()

    async def end(self, data: bytes) -> None:
        self.ended = True
        self.conn._write(_chunk(data) + _LAST_CHUNK if data else _LAST_CHUNK)

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.full = _whole(status, body, {**(headers or {}), "Content-Type": content_type})


class Gateway:
    def __init__(self) -> None:
        self.calls: dict[str, Call] = {}
        self.port: int | None = None
        self.session: aiohttp.ClientSession | None = None
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.ready = asyncio.Event()

    async def start(self, connect_timeout: float, stall_timeout: float) -> None:
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=connect_timeout, sock_read=stall_timeout
            ),
            auto_decompress=True,
            trust_env=False,
        )
        self.ready.set()

    async def stop(self) -> None:
        for call in list(self.calls.values()):
            call.finish("incomplete", "the proxy shut down before the call started")
        self.calls.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self._server is not None:
            # Calls are aborted before the gateway stops, so shutdown need not wait for them.
            self._server.close()
            for conn in list(self.connections):
                conn._close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), _CLOSE_TIMEOUT_S)
            except TimeoutError:
                pass
            self._server = None
        self.ready.clear()

    def register(self, call: Call) -> str:
        """The path mitmproxy should request to run this call."""
        self.calls[call.record.call_id] = call
        return PATH_PREFIX + call.record.call_id

    def route(self, flow: HTTPFlow, call: Call) -> None:
        """Register `call` and point `flow` at this gateway, which runs it and streams its reply.
        The request goes with no body: the call already holds what it sends upstream."""
        assert self.port is not None
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = self.port
        flow.request.path = self.register(call)
        flow.request.method = "POST"
        flow.request.headers = Headers(host=f"127.0.0.1:{self.port}", content_length="0")
        flow.request.content = b""

    def drop(self, call_id: str) -> Call | None:
        return self.calls.pop(call_id, None)
