"""The in-process endpoint mitmproxy forwards captured calls to.

mitmproxy's own upstream handling answers a refused connection with an HTML 502 and a reset
mid-stream with a closed socket; a harness needs its own dialect's error instead. So the addon
points each captured flow at this loopback server, which runs the `Call` — the upstream request,
token capture, translation — and streams the harness's reply back through mitmproxy with
`flow.response.stream` set, chunk by chunk. The harness's request body never crosses the
loopback: the call is looked up by the id in the path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from .exchange import Call, ClientGone

log = logging.getLogger(__name__)
PATH_PREFIX = "/polar-call/"
# What a write to the harness raises once it has left (aiohttp: RuntimeError after the transport
# closed). Caught inline in each write: the per-chunk path pays no extra call for it.
_HARNESS_GONE = (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError)


class _WebOutput:
    """`exchange.Output` over an aiohttp response; a failed write means the harness left."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self, status: int, content_type: str) -> None:
        response = web.StreamResponse(
            status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        self.response = response
        try:
            await response.prepare(self.request)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as e:
            raise ClientGone() from e

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except _HARNESS_GONE as e:
            raise ClientGone() from e

    async def end(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write_eof(data)
        except _HARNESS_GONE as e:
            raise ClientGone() from e

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.response = web.Response(
            status=status, body=body, headers={**(headers or {}), "Content-Type": content_type}
        )


class Gateway:
    def __init__(self) -> None:
        self.calls: dict[str, Call] = {}
        self.port: int | None = None
        self.session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.ready = asyncio.Event()

    async def start(self, connect_timeout: float, stall_timeout: float) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=1 << 20)
        app.router.add_route("*", PATH_PREFIX + "{call_id}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        # Calls are aborted before the gateway stops, so shutdown need not wait for handlers.
        site = web.TCPSite(runner, "127.0.0.1", 0, shutdown_timeout=2.0)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.ready.clear()

    def register(self, call: Call) -> str:
        """The path mitmproxy should request to run this call."""
        self.calls[call.record.call_id] = call
        return PATH_PREFIX + call.record.call_id

    def drop(self, call_id: str) -> Call | None:
        return self.calls.pop(call_id, None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        call = self.calls.pop(request.match_info["call_id"], None)
        if call is None or self.session is None:
            return web.json_response({"error": {"message": "unknown call"}}, status=404)
        out = _WebOutput(request)
        await call.run(out, self.session)
        if out.response is None:  # cannot happen: every path of run() answers
            log.error("polar-mitm: call %s produced no response", call.record.call_id)
            return web.json_response({"error": {"message": "no response"}}, status=500)
        if isinstance(out.response, web.Response):
            return out.response
        try:
            await out.response.write_eof()
        except _HARNESS_GONE:
            pass
        return out.response
