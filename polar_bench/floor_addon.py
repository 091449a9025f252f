"""The floors for any addon, for polar_bench's proxy columns: plain mitmdump plus the least an
LLM proxy must do — send api.openai.com to the policy server — and, with BENCH_STREAM=1, stream the
reply (`flow.response.stream = True`). Without it, mitmdump's default: buffer, then replay.

With BENCH_CAPTURE=1 as well, the least a *token-capturing* addon must do on top: ask the server
for token ids and logprobs (so every chunk carries them) and JSON-decode each streamed event to
read them. The chunks go on to the client unchanged (no translation, no stripping, nothing
written): whatever polar-mitm costs above this column is its own work, not the price of capture.
The request's rewrite and every event are decoded with msgspec, the fastest JSON decoder in reach
and the one polar-mitm uses (`polar_mitm/core/fastjson.py`): a floor the stdlib's `json` would raise
(it decodes a 60k-id first chunk about twice as slowly).

With BENCH_GATEWAY=1 instead, the least a proxy built like polar-mitm must do: send each call
through an in-process loopback gateway (polar-mitm's own `call/gateway.py`) that makes the upstream
request itself and streams the reply back through mitmproxy, chunk by chunk, bytes unchanged. That
hop is what lets polar-mitm answer a refused or reset upstream in the harness's dialect (mitmproxy
would send an HTML 502 or cut the socket) and hold a reply's end until its record is durable (a
`flow.response.stream` callable cannot wait); this column prices the hop alone: nothing decoded,
asked for or written.

(map_remote + stream_large_bodies cannot be the floor: with request streaming on, the server
connection opens at requestheaders time, before map_remote rewrites the URL in `request`.)
"""

import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import msgspec
from mitmproxy import http

_UP = urlsplit(os.environ["BENCH_UPSTREAM"])
_STREAM = os.environ.get("BENCH_STREAM") == "1"
_CAPTURE = os.environ.get("BENCH_CAPTURE") == "1"
_DECODE = msgspec.json.Decoder().decode
_ENCODE = msgspec.json.Encoder().encode


def requestheaders(flow: http.HTTPFlow) -> None:
    if flow.request.host == "api.openai.com":
        flow.request.scheme = "http"
        flow.request.host = _UP.hostname
        flow.request.port = _UP.port


class _Relay:
    """A call for the gateway that only relays: the request as the harness sent it (rerouted),
    the reply's bytes as the server sent them."""

    def __init__(self, flow: http.HTTPFlow, call_id: str) -> None:
        self.record = SimpleNamespace(call_id=call_id)  # all the gateway reads of a call's record
        self.url = flow.request.url
        self.body = flow.request.content or b""
        self.headers = {"Content-Type": flow.request.headers.get("content-type", "")}

    async def run(self, out, session) -> None:  # noqa: ANN001 (gateway's Output, aiohttp session)
        async with session.post(self.url, data=self.body, headers=self.headers) as reply:
            await out.start(reply.status, reply.headers.get("Content-Type", ""))
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
        await out.end(b"")


class _GatewayFloor:
    """BENCH_GATEWAY's hooks, an addon of their own so that the other columns keep a plain
    synchronous `request` hook."""

    def __init__(self) -> None:
        # Imported here, so that the other columns' processes load nothing of polar-mitm.
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's
        from polar_mitm.call.gateway import Gateway

        self.gateway = Gateway()
        self.call_ids = itertools.count()

    async def running(self) -> None:
        await self.gateway.start(connect_timeout=10, stall_timeout=600)

    async def done(self) -> None:
        await self.gateway.stop()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.host != _UP.hostname or flow.response is not None:
            return
        await self.gateway.ready.wait()  # mitmdump says it listens before the scripts' `running`
        relay = _Relay(flow, str(next(self.call_ids)))
        self.gateway.route(flow, relay)  # type: ignore[arg-type]

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            flow.response.stream = True


def request(flow: http.HTTPFlow) -> None:
    if _CAPTURE and flow.request.path.startswith("/v1/chat/completions"):
        body = _DECODE(flow.request.content or b"{}")
        body.update(return_token_ids=True, logprobs=True, top_logprobs=0)
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        flow.request.content = _ENCODE(body)


class _ReadIds:
    """A `flow.response.stream` callable: splits the SSE stream into events, decodes each one
    and keeps its token ids; passes every byte through as it came. Linear in the stream: a
    long call's first event (the prompt's ids, hundreds of KB) arrives in many reads, and each
    read searches only the bytes not searched before."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.scan = 0
        self.ids: list[int] = []

    def __call__(self, data: bytes) -> bytes:
        buf = self.buffer
        buf += data
        start, end = 0, buf.find(b"\n\n", self.scan)
        while end >= 0:
            for line in bytes(buf[start:end]).split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = _DECODE(line[6:])
                    for choice in chunk.get("choices") or ():
                        self.ids.extend(choice.get("token_ids") or ())
            start, end = end + 2, buf.find(b"\n\n", end + 2)
        del buf[:start]
        self.scan = max(len(buf) - 1, 0)
        return data


def responseheaders(flow: http.HTTPFlow) -> None:
    if _CAPTURE and flow.response.headers.get("content-type", "").startswith("text/event-stream"):
        flow.response.stream = _ReadIds()
    elif _STREAM:
        flow.response.stream = True


addons = [_GatewayFloor()] if os.environ.get("BENCH_GATEWAY") == "1" else []
