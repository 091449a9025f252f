"""The reference policy server: an aiohttp app speaking a policy server's wire format.

Endpoints (vLLM kind):

* ``POST /v1/chat/completions`` — scripted turns, streaming or not, with real token ids;
* ``POST /v1/completions`` with a prompt of token ids (SGLang kind: ``POST /generate`` with
  ``input_ids``) — the same scripted turns for exact-prefix mode (``completions.py``);
* ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``;
* test control under ``/_polar/``: ``POST /_polar/release`` (let held last chunks go; answers
  ``{"released": n}``; ``?wait=S`` first waits up to S seconds until a reply is held), ``GET /_polar/requests`` (the last 100 requests to the API endpoints, newest
  last, as ``{"method", "path", "query", "headers", "body", "raw"}``: ``body`` is the decoded JSON or
  ``null``, ``raw`` the body text exactly as received), ``POST /_polar/reset`` (forget the log, the
  armed faults and the counters, and let every held stream go), ``POST /_polar/faults`` (arm a fault
  for the request whose first user message is ``key``: ``{"key", "fault"}`` or a list of them; see
  ``faults.py``), ``GET /_polar/stats`` (counters: ``chat_requests``, ``streams_started``,
  ``streams_completed``, ``bytes_sent`` (stream bytes written), ``client_gone`` — the client closed the connection before the reply was
  sent, e.g. a proxy that cancelled the call — and ``resets``, connections reset by a fault).

Work per request: the chat template and tokenization run in a worker thread (``asyncio.to_thread``) so
other streams keep flowing, and the wire kind turns the result into the exact bytes of every chunk
before the first one is written; the send loop only paces and writes.

Adding a wire kind is one module behind :class:`~polar_reference.wire.Wire`; adding an
endpoint (e.g. a token-in ``/v1/completions``) is one module with an ``add_routes(app, server)`` passed
as ``extra_routes`` to :meth:`PolicyServer.app`, reusing :meth:`PolicyServer.play`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from polar_mitm.core import fastjson
from polar_mitm.tokens.conversation import RequestError, render_input

from .faults import STANDALONE, apply_fault, fault_spec
from .generation import sample
from .render import Renderer
from .scenario import Scenario
from .versions import VLLM_LIMITS
from .wire import ChatCall, ReplyPlan, Wire, WireError
from .wire_kinds import WIRE_KINDS

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 30.0
REQUEST_LOG_SIZE = 100
#: The request flags that ask a server for token ids; --ignore-token-flags drops them unread, as a
#: server that does not know them (vLLM < 0.10.2, SGLang before PR #23751, plain servers) would.
TOKEN_FLAGS = (
    "return_token_ids",
    "return_prompt_token_ids",
    "return_meta_info",
    "return_input_ids",
    "return_output_ids",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
)
#: SGLang 0.5.23's stream-compatible id flags; --no-sglext drops them, as an SGLang before them
#: would, so the proxy's probe finds no sglext ids and keeps calling non-streaming.
SGLEXT_FLAGS = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs; the CLI fills it from flags."""

    scenario: Scenario
    model: str | None = None  # served model name; default: the scenario's
    tokenizer_dir: Path | None = None  # default: the bundled Qwen3 tokenizer
    token_rate: float = 0.0  # tokens/s per stream; 0 = as fast as possible
    chunk_tokens: int = 1
    reasoning_field: str = "reasoning"
    kind: str = "vllm"
    max_model_len: int | None = None  # default: the tokenizer's model_max_length
    ignore_token_flags: bool = False  # act like a server without token ids (old vLLM/SGLang, plain)
    vllm_limits: str = VLLM_LIMITS[0]  # how the vllm kind applies the context (versions.py)
    sglext: bool = True  # sglang kind: honour return_{input,output}_ids_in_sglext (0.5.23)
    scale_out: bool = False  # vllm kind: /inference/v1/generate answers (else 403, as vLLM)


class Control:
    """Test-control state: the request log and the streams holding their last chunk."""

    def __init__(self) -> None:
        self.requests: deque[tuple[dict[str, Any], bytes]] = deque(maxlen=REQUEST_LOG_SIZE)
        self.armed: dict[str, Any] = {}  # first user message -> fault spec, used once
        self.stats: Counter[str] = Counter()
        self._holds: set[asyncio.Event] = set()
        self._held = asyncio.Event()  # set while at least one hold is registered

    def hold(self) -> asyncio.Event:
        """Register a hold *before* the stream starts, so a release that races the stream still counts."""
        event = asyncio.Event()
        self._holds.add(event)
        self._held.set()
        return event

    async def until_held(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until some reply is being held: ``release?wait=S``."""
        try:
            await asyncio.wait_for(self._held.wait(), timeout)
        except TimeoutError:
            pass

    async def wait(self, event: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(event.wait(), HOLD_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "held chunk released after %.0f s without POST /_polar/release", HOLD_TIMEOUT_S
            )
        finally:
            self.forget(event)

    def forget(self, event: asyncio.Event) -> None:
        self._holds.discard(event)
        if not self._holds:
            self._held.clear()

    def release(self) -> int:
        pending = [e for e in self._holds if not e.is_set()]
        for event in pending:
            event.set()
        self._holds.clear()
        self._held.clear()
        return len(pending)

    def reset(self) -> None:
        self.requests.clear()
        self.armed.clear()
        self.stats.clear()
        self.release()

    def arm(self, body: Any) -> int:
        """``POST /_polar/faults``: remember faults by the first user message they apply to."""
        items = body if isinstance(body, list) else [body]
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("key"), str):
                raise ValueError("each armed fault needs a string 'key' and a 'fault'")
            self.armed[item["key"]] = item.get("fault")
        return len(items)

    def take_armed(self, body: Any) -> Any:
        """The fault armed for this request body (removed: it fires once), or None."""
        if not self.armed or not isinstance(body, dict):
            return None
        key = _first_user_text(body.get("messages"))
        return self.armed.pop(key, None) if key is not None else None


def _first_user_text(messages: Any) -> str | None:
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                content = "\n".join(p for p in parts if isinstance(p, str))
            return content if isinstance(content, str) else None
    return None


def _reset_connection(request: web.Request) -> None:
    """Close the connection with a TCP RST (SO_LINGER 0), the way a crashed server's peer sees it."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _stall(request: web.Request, seconds: float) -> bool:
    """Send nothing for ``seconds``; False as soon as the client closes the connection."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        await asyncio.sleep(min(left, 0.05))
    return True


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
    )


def _logged(entry: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """One request of the log as `/_polar/requests` shows it: its body decoded (null when it is
    not JSON) and as text."""
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        body = None
    return {**entry, "body": body, "raw": raw.decode("utf-8", errors="replace")}


class PolicyServer:
    """One served model playing one scenario."""

    #: The token-in endpoint (``/v1/completions``, SGLang ``/generate``): scripted turns found
    #: from the prompt ids (completions.py).
    token_in_routes = True

    def __init__(self, config: ServerConfig, renderer: Renderer | None = None):
        self.config = config
        self.scenario = config.scenario
        self.served_model = config.model or config.scenario.model
        self.renderer = renderer or Renderer(config.tokenizer_dir)
        self.max_model_len = config.max_model_len or self.renderer.max_model_len
        if config.vllm_limits not in VLLM_LIMITS:
            raise ValueError(f"vllm_limits must be one of {VLLM_LIMITS}")
        #: Whose context-length rules apply (generation.token_limit).
        self.limits = "sglang" if config.kind == "sglang" else config.vllm_limits
        factory = WIRE_KINDS.get(config.kind)
        if factory is None:
            raise ValueError(
                f"unknown policy server kind {config.kind!r} (known: {', '.join(WIRE_KINDS)})"
            )
        self.wire: Wire = factory(
            reasoning_field=config.reasoning_field, chunk_tokens=config.chunk_tokens
        )
        self.control = Control()
        self.runner: web.AppRunner | None = None

    # -- app ---------------------------------------------------------------------------------

    def app(
        self, extra_routes: Iterable[Callable[[web.Application, PolicyServer], None]] = ()
    ) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._record], client_max_size=256 * 1024**2
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/_polar/release", self.release)
        app.router.add_get("/_polar/requests", self.requests)
        app.router.add_post("/_polar/reset", self.reset)
        app.router.add_post("/_polar/faults", self.arm_faults)
        app.router.add_get("/_polar/stats", self.stats)
        if self.token_in_routes:
            from .completions import add_routes as token_in

            token_in(app, self)
            if self.wire.kind == "vllm":
                from .vllm_generate import add_routes as generate

                generate(app, self, self.config.scale_out)
        for add_routes in extra_routes:
            add_routes(app, self)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen and return the base URL (``port=0`` picks a free port)."""
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound_host, bound_port = self.runner.addresses[0][:2]
        shown = host if host not in ("0.0.0.0", "::", "") else bound_host
        if ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{bound_port}"

    async def stop(self) -> None:
        self.control.release()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler):
        if not request.path.startswith("/_polar/") and request.path != "/health":
            # The body as bytes: `requests` decodes it when asked. A token-in prompt is 500 KB
            # of ids, and decoding every one here, on the event loop, was a sixth of the
            # server's time under the long load (polar_bench/long.py).
            entry = {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "headers": dict(request.headers),
            }
            self.control.requests.append((entry, await request.read()))
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except WireError as e:
            return _json(e.body, e.status)
        except web.HTTPException as e:
            if e.status in (404, 405):  # FastAPI's shape, as vLLM answers unknown routes
                return _json({"detail": e.reason}, e.status)
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            log.exception("internal error on %s", request.path)
            return _json(self.wire.error(500, str(e), "InternalServerError"), 500)

    # -- helpers -----------------------------------------------------------------------------

    async def _body(self, request: web.Request, ids: str | None = None) -> Any:
        """The JSON body; with `ids`, that top-level key's list of ids as an int32 array where
        it is one (a token-in prompt: `fastjson.loads_ids`)."""
        raw = await request.read()
        try:  # msgspec, once (a token-in prompt is 500 KB of ids); the stdlib's words on errors
            return fastjson.loads_ids(raw, ids) if ids else fastjson.loads(raw)
        except (ValueError, RecursionError):
            error = self.wire.invalid_json(raw)
            if error is not None:
                raise error from None
            raise

    def check_model(self, model: Any) -> None:
        """vLLM's 404 for a model it does not serve (no model named: the served one)."""
        if model and model != self.served_model:
            raise WireError(
                404,
                self.wire.error(
                    404, f"The model `{model}` does not exist.", "NotFoundError", "model"
                ),
            )

    def _bad_request(self, e: RequestError) -> WireError:
        return WireError(400, self.wire.error(400, str(e), "BadRequestError", e.param))

    def plan(self, call: ChatCall, armed: Any = None) -> ReplyPlan:
        """Generate and build the reply (blocking: run it in a thread). An ``armed`` fault (see
        ``POST /_polar/faults``) replaces the turn's."""
        result = sample(self.renderer, self.scenario, call, self.max_model_len, self.limits)
        plan = self.wire.chat_reply(call, result, self.served_model)
        plan.hold = result.turn.hold_last
        plan.delay_s = result.turn.delay_s
        return apply_fault(armed if armed is not None else result.turn.fault, plan)

    async def play(self, request: web.Request, plan: ReplyPlan) -> web.StreamResponse:
        """Send a plan: delay, pacing (``--token-rate``: a stream's chunks as their tokens are
        generated, a whole reply once all of them are), the optional hold before the final event."""
        held = self.control.hold() if plan.hold else None
        stats = self.control.stats
        try:
            if plan.delay_s > 0:
                await asyncio.sleep(plan.delay_s)
            if plan.stall_after == 0 and not await _stall(request, plan.stall_s):
                stats["client_gone"] += 1
                return web.Response()
            if plan.abort_after == 0:
                stats["resets"] += 1
                _reset_connection(request)
                return web.Response()
            if not plan.stream:
                if self.config.token_rate > 0 and sum(plan.tokens):
                    # a server answers a whole reply once it is generated, at the same pace
                    await asyncio.sleep(sum(plan.tokens) / self.config.token_rate)
                if held is not None:
                    await self.control.wait(held)
                body = b"".join(plan.events)
                headers = {"Content-Type": plan.content_type, **plan.headers}
                if plan.abort_after is not None:  # reset half-way through the body
                    response = web.StreamResponse(status=plan.status, headers=headers)
                    response.content_length = len(body)
                    await response.prepare(request)
                    await response.write(body[: len(body) // 2])
                    stats["resets"] += 1
                    _reset_connection(request)
                    return response
                return web.Response(body=body, status=plan.status, headers=headers)
            response = web.StreamResponse(
                status=plan.status,
                headers={
                    "Content-Type": plan.content_type,
                    "Cache-Control": "no-cache",
                    **plan.headers,
                },
            )
            await response.prepare(request)
            stats["streams_started"] += 1
            rate = self.config.token_rate
            loop = asyncio.get_running_loop()
            start, generated = loop.time(), 0
            try:
                for i, event in enumerate([*plan.events, None]):
                    if i == plan.abort_after:
                        stats["resets"] += 1
                        _reset_connection(request)
                        return response
                    if i == plan.stall_after and not await _stall(request, plan.stall_s):
                        stats["client_gone"] += 1
                        return response
                    if event is None:
                        break
                    if held is not None and i == plan.final_index:
                        await self.control.wait(held)
                        held = None
                        start, generated = loop.time(), 0
                    if rate > 0 and plan.tokens[i]:
                        generated += plan.tokens[i]
                        wait = start + generated / rate - loop.time()
                        if wait > 0:
                            await asyncio.sleep(wait)
                    await response.write(event)
                    stats["bytes_sent"] += len(event)
                await response.write_eof()
                stats["streams_completed"] += 1
            except (ConnectionResetError, ConnectionError):
                stats["client_gone"] += 1
                log.info("client went away mid-stream")
            return response
        finally:
            if held is not None:
                self.control.forget(held)

    # -- handlers ----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if self.config.ignore_token_flags and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in TOKEN_FLAGS}
        elif not self.config.sglext and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in SGLEXT_FLAGS}
        self.control.stats["chat_requests"] += 1
        armed = self.control.take_armed(body)
        spec = fault_spec(armed)
        if spec is not None and spec["mode"] in STANDALONE:  # no generation needed
            empty = ReplyPlan(200, "text/event-stream", [], [], stream=bool(body.get("stream")))
            return await self.play(request, apply_fault(spec, empty))
        call = self.wire.parse_chat(body, self.served_model)
        try:
            plan = await asyncio.to_thread(self.plan, call, armed)
        except RequestError as e:
            raise self._bad_request(e) from None
        return await self.play(request, plan)

    async def models(self, request: web.Request) -> web.Response:
        return _json(self.wire.models(self.served_model, self.scenario.model, self.max_model_len))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    def _tokenize_ids(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            inp = render_input(body, getattr(self.wire, "flavor", "vllm"))
            return list(self.renderer.prompt(inp).ids)
        if isinstance(body.get("prompt"), str):
            return self.renderer.encode_text(
                body["prompt"], bool(body.get("add_special_tokens", True))
            )
        raise RequestError("either 'messages' or 'prompt' is required", param="prompt")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise self._bad_request(RequestError("the body must be a JSON object"))
        self.check_model(body.get("model"))
        try:
            ids = await asyncio.to_thread(self._tokenize_ids, body)
        except RequestError as e:
            raise self._bad_request(e) from None
        strs = (
            self.renderer.tokenizer.convert_ids_to_tokens(ids)
            if body.get("return_token_strs")
            else None
        )
        return _json(self.wire.tokenize(ids, self.max_model_len, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise self._bad_request(
                RequestError("'tokens' must be a list of integers", param="tokens")
            )
        return _json({"prompt": self.renderer.decode(tokens)})

    async def release(self, request: web.Request) -> web.Response:
        try:
            wait = min(float(request.query.get("wait", 0)), HOLD_TIMEOUT_S)
        except ValueError:
            wait = 0.0
        if wait > 0:
            await self.control.until_held(wait)
        return _json({"released": self.control.release()})

    async def requests(self, request: web.Request) -> web.Response:
        return _json([_logged(entry, raw) for entry, raw in self.control.requests])

    async def reset(self, request: web.Request) -> web.Response:
        self.control.reset()
        return _json({"ok": True})

    async def arm_faults(self, request: web.Request) -> web.Response:
        try:
            armed = self.control.arm(await request.json())
        except ValueError as e:
            return _json({"error": str(e)}, 400)
        return _json({"armed": armed})

    async def stats(self, request: web.Request) -> web.Response:
        return _json(dict(self.control.stats))
