"""A recording pass-through in front of the real vLLM: what the proxy sent upstream and what the
engine answered, byte for byte (streams are passed on chunk by chunk as they come).

The reference policy server keeps its own request log (``/_polar/requests``); vLLM has none, and
"the ids the proxy recorded are the ids the engine sampled" needs the engine's own reply, so
every test of the tier puts one of these between mitmdump and vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tests.helpers.clients import completion_ids

_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "host"}


@dataclass
class Exchange:
    method: str
    path: str
    body: Any
    status: int = 0
    raw: bytes = b""
    stream: bool = False
    _events: list[dict] | None = field(default=None, repr=False)

    @property
    def events(self) -> list[dict]:
        """The SSE ``data:`` payloads of a streamed reply (``[DONE]`` left out)."""
        if self._events is None:
            self._events = [
                json.loads(line[6:])
                for line in self.raw.decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        return self._events

    @property
    def reply(self) -> dict:
        """A non-streamed reply's JSON."""
        return json.loads(self.raw)

    def sampled(self) -> tuple[list[int], list[int], list[float]]:
        """(prompt ids, output ids, output logprobs) the engine returned, chat or completions,
        streamed or not. A token-in request (a list of ids as `prompt`) is not echoed back
        (the proxy asks `return_tokens_as_token_ids` instead of `return_token_ids`): its prompt
        is the ids sent, checked against the engine's `usage.prompt_tokens`, and its sampled
        ids are the logprobs' ``token_id:N`` names."""
        chunks = self.events if self.stream else [self.reply]
        body = self.body if isinstance(self.body, dict) else {}
        sent = body.get("prompt", body.get("token_ids"))  # /v1/completions, /inference/v1/generate
        prompt: list[int] = []
        out: list[int] = []
        lps: list[float] = []
        usage: dict = {}
        for chunk in chunks:
            usage = chunk.get("usage") or usage
            if chunk.get("prompt_token_ids"):
                prompt = chunk["prompt_token_ids"]
            for choice in chunk.get("choices") or ():
                prompt = choice.get("prompt_token_ids") or prompt
                logprobs = choice.get("logprobs") or {}
                if choice.get("token_ids") is not None or "tokens" in logprobs:
                    out += completion_ids(choice)
                if "content" in logprobs:
                    lps += [e["logprob"] for e in logprobs["content"] or ()]
                else:
                    lps += logprobs.get("token_logprobs") or []
        if not prompt and isinstance(sent, list):
            assert usage.get("prompt_tokens") == len(sent), (usage, len(sent))
            prompt = sent
        return prompt, out, lps


class Recorder:
    """Serves on 127.0.0.1 in a thread of its own; ``url`` goes to ``polar_upstream``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/_polar/requests", self._log)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _log(self, request: web.Request) -> web.Response:
        """The reference server's request log, in its shape, so its e2e helpers work here."""
        entries = [{"method": e.method, "path": e.path, "body": e.body} for e in self.exchanges]
        return web.json_response(entries)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        try:
            body = json.loads(data) if data else None
        except ValueError:
            body = data.decode(errors="replace")
        exchange = Exchange(request.method, request.path_qs, body)
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=data, headers=headers
        ) as up:
            exchange.status = up.status
            exchange.stream = up.headers.get("content-type", "").startswith("text/event-stream")
            out = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP},
            )
            await out.prepare(request)
            async for piece in up.content.iter_any():
                exchange.raw += piece
                await out.write(piece)
            await out.write_eof()
            return out

    def chats(self, path: str = "/v1/chat/completions") -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path == path]

    def stop(self) -> None:
        async def close() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
