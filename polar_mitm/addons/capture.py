"""`CaptureAddon`: detects LLM calls on `polar_hosts`, sends them to the policy server through the
in-process gateway, answers the other paths of those hosts.

Over 500 lines because `CaptureAddon` is one mitmproxy addon: its eight options, their checks in
`configure`, and the hooks of one flow (`request` -> `_start_call` -> `responseheaders` /
`error` -> `_call_done`) share the flow's state and the gateway, so splitting the hooks apart
would split one call's lifecycle across files. The work itself is in `call/` and `dialects/`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
from mitmproxy import ctx, http

from ..call.exchange import Call, UpstreamSettings
from ..call.gateway import Gateway
from ..call.identity import API_KEY_PREFIX, KEY_PARAM
from ..control import ControlState
from ..core.record import CallRecord, CallSink, deliver, now_us
from ..core.redaction import (
    KEY_HEADERS,
    REDACTED,
    SECRET_HEADERS,
    redact_headers,
    redacted_json,
    scrub,
    secret_values,
)
from ..dialects import Dialect, DialectError, HarnessRequest, detect
from ..metrics import ProxyMetrics
from ..tokens.count import PromptCounter
from ..trajectory.lineage import agent_of, purpose_of
from ..upstream import UPSTREAMS, Upstream, kind_from_models
from .constraints import ConstraintsAddon
from .exact_prefix import ExactPrefixAddon
from .identity import RolloutIdentityAddon
from .options import _errors, _seconds, log
from .retokenize import RetokenizeAddon
from .tokenizer import TokenizerAddon
from .warmup import WarmUpAddon

# ab.chatgpt.com is Codex's telemetry (OpenTelemetry metrics, docs/harness-wire-notes.md), and
# play.googleapis.com Gemini CLI's (Clearcut `/log`): neither has an LLM endpoint, so listing them
# answers all of it locally and no rollout leaks telemetry.
DEFAULT_HOSTS = (
    "api.openai.com,api.anthropic.com,chatgpt.com,ab.chatgpt.com,"
    "generativelanguage.googleapis.com,play.googleapis.com"
)
_RAW_BODY_LIMIT = 1 << 20
# A harness (or a test) may say what a call is for; anything but "main" is a side call.
PURPOSE_HEADER = "x-polar-purpose"
_PURPOSE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def _secrets(flow: http.HTTPFlow) -> list[str]:
    """The request's credentials: its secret headers' values, and Google's `?key=`."""
    values = secret_values(flow.request.headers)
    key = flow.request.query.get(KEY_PARAM)
    if key and len(key) >= 6:
        values.append(key)
    return values


def _forget_secrets(flow: http.HTTPFlow) -> None:
    """A flow answered here goes nowhere: drop its credentials, so that mitmproxy's own output
    (its flow lines, flow_detail 3+, `-w` flow files) and other addons never see them."""
    headers = flow.request.headers
    values = _secrets(flow)
    for name in SECRET_HEADERS:
        headers.pop(name, None)
    if KEY_PARAM in flow.request.query:
        del flow.request.query[KEY_PARAM]
    content = flow.request.raw_content
    if values and content:
        for value in values:
            content = content.replace(value.encode(), REDACTED.encode())
        flow.request.raw_content = content


def _drop_polar_keys(request: http.Request) -> None:
    """Take every `polar-` key out of a request bound for the real host: in any key header, and
    Google's `?key=` (a real key beside it goes on)."""
    for name in KEY_HEADERS:
        value = request.headers.get(name, "")
        key = value[7:] if value[:7].lower() == "bearer " else value
        if key.strip().startswith(API_KEY_PREFIX):
            del request.headers[name]
    if request.query.get(KEY_PARAM, "").startswith(API_KEY_PREFIX):
        del request.query[KEY_PARAM]


def _json_response(status: int, obj: object) -> http.Response:
    return http.Response.make(status, json.dumps(obj), {"content-type": "application/json"})


class CaptureAddon:
    def __init__(
        self,
        identity: RolloutIdentityAddon,
        *,
        sinks: Sequence[CallSink],
        retokenize: RetokenizeAddon | None = None,
        control: ControlState | None = None,
        tokenizer: TokenizerAddon | None = None,
        exact: ExactPrefixAddon | None = None,
        metrics: ProxyMetrics | None = None,
        constraints: ConstraintsAddon | None = None,
        warmup: WarmUpAddon | None = None,
    ) -> None:
        """Everything the capture uses is handed in here (polar.py builds them first), never set
        on the instance afterwards: what an addon depends on is read in one signature."""
        self.identity = identity
        self.exact = exact
        self.sinks = list(sinks)
        self.stall_timeout = 300.0
        self.buffer_replies = False  # polar_upstream_stream=buffer
        self.stream_interval = 1  # polar_stream_interval
        self.connect_timeout = 10.0
        self.retokenize = retokenize
        self.control = control
        self.tokenizer = tokenizer  # for requests answered locally (count_tokens)
        self.gateway = Gateway()
        self.upstream: Upstream | None = None
        self.auto_base: str | None = None  # polar_upstream_kind=auto: the URL still to probe
        self._probe_lock = asyncio.Lock()
        self.hosts: frozenset[str] = frozenset()
        self.served_model: str | None = None
        self.max_model_len: int | None = None  # the served model's, from GET /v1/models
        self.live: dict[str, Call] = {}
        self.metrics = metrics  # observes each call's added latency
        self.warmup = warmup  # runs once the gateway listens
        self.constraints = constraints  # what goes upstream of parallel_tool_calls=false
        self._announcing: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_upstream",
            str,
            "",
            "Base URL of the policy server (vLLM or SGLang), e.g. http://127.0.0.1:8000. Required.",
        )
        loader.add_option(
            "polar_upstream_kind",
            str,
            "vllm",
            "Policy server kind: vllm, sglang, openai (a plain OpenAI-compatible server that "
            "returns no token ids: every record is retokenized) or auto (probe GET /v1/models "
            "once at start-up).",
        )
        loader.add_option(
            "polar_model",
            str,
            "",
            "Model name sent upstream (default: the first model the server lists). "
            "The harness's own model name is recorded and restored in replies.",
        )
        loader.add_option(
            "polar_hosts",
            str,
            DEFAULT_HOSTS,
            "Comma-separated hosts whose LLM endpoints are captured.",
        )
        loader.add_option(
            "polar_other_paths",
            str,
            "answer",
            "Non-LLM paths on polar_hosts: 'answer' them locally with a JSON 404, or 'pass' them "
            "to the real host (polar- API keys are never forwarded).",
        )
        self._load_timeouts(loader)

    @staticmethod
    def _load_timeouts(loader) -> None:
        """The options of how long and how a call may take upstream, and how large it may be."""
        loader.add_option(
            "polar_upstream_timeout",
            str,
            "300",
            "Seconds the policy server may stay silent (before the first byte or between chunks) "
            "before the call fails with the dialect's error.",
        )
        loader.add_option(
            "polar_connect_timeout", str, "10", "Seconds to wait for the policy server to accept."
        )
        loader.add_option(
            "polar_upstream_stream",
            str,
            "relay",
            "How a streamed harness call reaches the policy server: 'relay' streams it and passes "
            "each chunk on as it comes; 'buffer' asks for the whole reply at once and streams it "
            "to the harness when complete (no per-token chunks for the server to build or the "
            "proxy to parse: a headless farm's cheapest setting; the harness sees no text until "
            "the reply is done, and polar_upstream_timeout bounds the whole generation).",
        )
        loader.add_option(
            "polar_stream_interval",
            int,
            1,
            "vLLM (>= 0.32) only: tokens per streamed chunk when relaying (the request's "
            "stream_interval; the first token still comes alone and at once). 1: every token its "
            "own chunk, as the server sends by default; 16 cuts the chunks the server builds and "
            "the proxy parses sixteenfold and keeps the stream.",
        )
        loader.add_option(
            "polar_max_request_mb",
            int,
            64,
            "Largest harness request body (MB) an LLM call may have; a larger one is refused with "
            "HTTP 413 in the harness's own error shape (and recorded). 0: no limit.",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "polar_upstream_timeout" in updated:
            self.stall_timeout = (
                _seconds("polar_upstream_timeout", opts.polar_upstream_timeout, zero_ok=False)
                or 300.0
            )
        if "polar_connect_timeout" in updated:
            self.connect_timeout = (
                _seconds("polar_connect_timeout", opts.polar_connect_timeout, zero_ok=False) or 10.0
            )
        if {"polar_upstream", "polar_upstream_kind"} & updated:
            self._configure_upstream(opts)
        if "polar_hosts" in updated:
            self.hosts = frozenset(
                h.strip().lower() for h in opts.polar_hosts.split(",") if h.strip()
            )
        if "polar_other_paths" in updated and opts.polar_other_paths not in ("answer", "pass"):
            _errors.fail(f"polar_other_paths: {opts.polar_other_paths!r} is not 'answer' or 'pass'")
        if "polar_model" in updated:
            self.served_model = opts.polar_model or None
        if "polar_upstream_stream" in updated:
            if opts.polar_upstream_stream not in ("relay", "buffer"):
                _errors.fail(
                    f"polar_upstream_stream: {opts.polar_upstream_stream!r} is not 'relay' or "
                    "'buffer'"
                )
            self.buffer_replies = opts.polar_upstream_stream == "buffer"
        if "polar_stream_interval" in updated:
            if opts.polar_stream_interval < 1:
                _errors.fail(
                    f"polar_stream_interval: {opts.polar_stream_interval} is not a whole "
                    "number of tokens >= 1"
                )
            self.stream_interval = max(opts.polar_stream_interval, 1)

    def _configure_upstream(self, opts) -> None:
        """polar_upstream and polar_upstream_kind: the upstream (or the URL kind auto probes)."""
        self.upstream = None
        self.auto_base = None
        url = opts.polar_upstream
        if not url:
            _errors.fail(
                "polar_upstream: required: the policy server's base URL, "
                "e.g. --set polar_upstream=http://127.0.0.1:8000"
            )
            return
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            _errors.fail(f"polar_upstream: {url!r} is not an http(s)://HOST[:PORT] URL")
            return
        kind = opts.polar_upstream_kind
        if kind not in UPSTREAMS and kind != "auto":
            _errors.fail(
                f"polar_upstream_kind: unknown kind {kind!r} "
                f"(choose from {', '.join(UPSTREAMS)}, auto)"
            )
            return
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        if kind == "auto":
            self.auto_base = base
        else:
            self.upstream = UPSTREAMS[kind](base)

    async def running(self) -> None:
        await self.gateway.start(self.connect_timeout, self.stall_timeout)
        if self.auto_base is not None:
            await self._probe_kind(announce=True)
        model = await self._served_model(announce=True)
        # A task: mitmproxy's TlsConfig reloads its certificate store in its own running hook,
        # after the scripts' (55 ms here, and it drops certificates made before), so the warm-up
        # and the "capturing" line that scripts wait for come once every running hook is done.
        self._announcing = asyncio.get_running_loop().create_task(self._announce(model))

    async def _announce(self, model: str | None) -> None:
        await asyncio.sleep(0)
        if self.warmup is not None:
            await self.warmup.run(self.gateway, self.hosts)
        upstream = self.upstream
        fallback = f"; {self.retokenize.describe()}" if self.retokenize is not None else ""
        log.info(
            "polar-mitm: capturing %s -> %s upstream %s (model %s%s)",
            ",".join(sorted(self.hosts)),
            upstream.kind if upstream is not None else "auto (not probed yet)",
            upstream.base_url if upstream is not None else self.auto_base,
            model or "not known yet",
            fallback,
        )
        book = self.exact.book if self.exact is not None else None
        if book is not None and upstream is not None and not upstream.token_in_path:
            log.warning(
                "polar-mitm: polar_exact_prefix: polar_upstream_kind=%s has no token-in endpoint; "
                "every call goes the chat way",
                upstream.kind,
            )
        off = self.retokenize is None or self.retokenize.retokenizer is None
        if upstream is not None and not upstream.returns_ids and off:
            log.warning(
                "polar-mitm: polar_upstream_kind=%s returns no token ids and polar_tokenizer is "
                "not set: records will have no ids (set polar_tokenizer to retokenize)",
                upstream.kind,
            )

    async def done(self) -> None:
        if self._announcing is not None and not self._announcing.done():
            self._announcing.cancel()
        for call in list(self.live.values()):
            call.abort("the proxy shut down mid-call", status="incomplete")
        if self.retokenize is not None:
            await self.retokenize.drain()
        if self.exact is not None:
            await self.exact.drain()
        await self.gateway.stop()

    # -- hooks --------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.host.lower().rstrip(".") not in self.hosts:
            return
        try:
            await self._capture(flow)
            if flow.response is not None:
                _forget_secrets(flow)
        except Exception as e:
            # Never let a flow on a captured host fall through to the real API (mitmproxy would
            # forward it after logging the error): answer it here, as the dialect would.
            log.exception(
                "polar-mitm: internal error on %s %s", flow.request.method, flow.request.path
            )
            dialect = detect(flow.request.method, flow.request.path.partition("?")[0])
            message = f"polar-mitm internal error: {type(e).__name__}: {e}"
            body = (
                dialect.error_bytes(500, message, "server_error")
                if dialect is not None
                else json.dumps({"error": {"message": message, "type": "server_error"}}).encode()
            )
            flow.response = http.Response.make(500, body, {"content-type": "application/json"})
            _forget_secrets(flow)

    async def _capture(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path.partition("?")[0]
        if flow.request.headers.get("upgrade", "").lower() == "websocket":
            flow.response = _json_response(
                426,
                {
                    "error": {
                        "message": "polar-mitm serves this endpoint over HTTP with server-sent events, "
                        "not WebSocket",
                        "type": "invalid_request_error",
                    }
                },
            )
            return
        dialect = detect(flow.request.method, path)
        if dialect is None:
            self._other_path(flow)
            return
        if self.upstream is None and self.auto_base is not None:
            await self.gateway.ready.wait()
            await self._probe_kind()
        if self.upstream is None:
            flow.response = http.Response.make(
                502,
                dialect.error_bytes(502, "polar-mitm has no valid polar_upstream", "server_error"),
                {"content-type": "application/json"},
            )
            return
        if self.control is not None and not await self.control.admit():  # paused: wait here
            flow.response = http.Response.make(
                503,
                dialect.error_bytes(503, "polar-mitm is shutting down", "server_error"),
                {"content-type": "application/json"},
            )
            return
        await self.gateway.ready.wait()
        await self._start_call(flow, dialect, path)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "polar_call" in flow.metadata and flow.response is not None:
            flow.response.stream = True  # the gateway already streams the harness's reply

    def error(self, flow: http.HTTPFlow) -> None:
        call_id = flow.metadata.get("polar_call")
        if not call_id:
            return
        pending = self.gateway.drop(call_id)
        call = pending or self.live.get(call_id)
        if call is not None:
            reason = flow.error.msg if flow.error else "connection error"
            call.abort(f"the harness connection failed: {reason}")

    # -- helpers ------------------------------------------------------------------------

    async def _start_call(self, flow: http.HTTPFlow, dialect: Dialect, path: str) -> None:
        """A recognized LLM call: its record, its parsed request (or a refusal in its dialect's
        shape), then a local answer or the gateway that runs it upstream."""
        secrets = _secrets(flow)
        record = self._new_record(flow, dialect, path, secrets)
        req = self._read_request(flow, dialect, path, record, secrets)
        if req is None:
            return
        self._describe(record, req, flow.request.headers)
        if req.local:
            await self._answer_locally(flow, dialect, req, record)
            return
        call = Call(
            record,
            dialect,
            req,
            settings=await self._settings(),
            sinks=self.sinks,
            secrets=secrets,
            on_done=self._call_done,
        )
        if self.metrics is not None:
            call.on_hold = self.metrics.durable_hold
        self.live[record.call_id] = call
        if self.control is not None:
            self.control.call_started(record.call_id, record.rollout_id)
        flow.metadata["polar_call"] = call.record.call_id
        self.gateway.route(flow, call)

    def _new_record(
        self, flow: http.HTTPFlow, dialect: Dialect, path: str, secrets: list[str]
    ) -> CallRecord:
        """The call's record as the request arrives: who, where, which upstream, which policy."""
        assert self.upstream is not None
        identity = self.identity.identify(flow)
        record = CallRecord(
            rollout_id=identity.rollout_id,
            rollout_source=identity.source,
            group_id=identity.group_id,
            sample_index=identity.sample_index,
            session_id=identity.session_id,
            dialect=dialect.name,
            method=flow.request.method,
            host=flow.request.host,
            path=path,
            upstream_kind=self.upstream.kind,
            upstream_url=self.upstream.base_url,
            policy_version=self.control.policy_version if self.control is not None else None,
        )
        headers = flow.request.headers.items(multi=True)
        record.headers_json = scrub(json.dumps(redact_headers(headers)), secrets)
        return record

    def _read_request(
        self,
        flow: http.HTTPFlow,
        dialect: Dialect,
        path: str,
        record: CallRecord,
        secrets: list[str],
    ) -> HarnessRequest | None:
        """The request parsed by its dialect, its redacted body on the record; None when it was
        refused (answered here in the dialect's error shape, the record delivered)."""
        body: bytes | None = None
        try:
            body = flow.request.get_content(strict=True) or b""
            limit = ctx.options.polar_max_request_mb
            if limit > 0 and len(body) > limit * 1e6:
                raise DialectError(
                    f"request body is {len(body) / 1e6:.1f} MB, more than polar_max_request_mb="
                    f"{limit:g}",
                    413,
                )
            refused = dialect.refuse_query(path, flow.request.query)
            if refused:
                raise DialectError(refused)
            req = dialect.parse(body, path)
            # the body as the harness sent it (valid UTF-8: `parse` checked) unless a key is blanked
            record.request_json = redacted_json(req.body, secrets, body.decode("utf-8"))
            return req
        except Exception as e:
            if isinstance(e, DialectError):
                error = e
            elif isinstance(e, RecursionError):  # json.loads went deeper than Python code can
                error = DialectError("request body is nested too deeply")
            elif isinstance(e, ValueError) and body is None:  # a bad content-encoding
                error = DialectError(f"request body cannot be decoded: {e}")
            else:
                log.exception("polar-mitm: call %s: cannot read the request", record.call_id)
                error = DialectError(f"polar-mitm internal error: {type(e).__name__}: {e}", 500)
                error.kind = "server_error"
            raw = (body or b"")[:_RAW_BODY_LIMIT].decode("utf-8", "replace")
            record.request_json = scrub(json.dumps({"unparsed_body": raw}), secrets)
            self._refuse(flow, dialect, record, error)
            return None

    @staticmethod
    def _describe(record: CallRecord, req: HarnessRequest, headers: http.Headers) -> None:
        """What the request says of itself: streaming, the model asked for, the agent, and what
        the call is for (the harness's header, else what the request says, else the dialect's)."""
        record.stream = req.stream
        record.model_requested = req.model
        purpose = headers.get(PURPOSE_HEADER, "").strip().lower()
        said = purpose_of(headers, req.body) if req.purpose == "main" else None
        record.purpose = purpose if _PURPOSE.match(purpose) else said or req.purpose
        record.agent = agent_of(headers)
        record.translation_notes = list(req.notes)

    async def _settings(self) -> UpstreamSettings:
        """How this call talks to the upstream (the served model asked for on the way)."""
        assert self.upstream is not None
        book = self.exact.book if self.exact is not None else None
        if book is not None:
            book.flavor = self.upstream.template_flavor  # known only now with kind auto
        settings = UpstreamSettings(
            self.upstream,
            await self._served_model(),
            connect_timeout=self.connect_timeout,
            stall_timeout=self.stall_timeout,
            retokenizer=self.retokenize.retokenizer if self.retokenize is not None else None,
            exact=book,
            max_model_len=self.max_model_len,
            buffer_replies=self.buffer_replies,
            stream_interval=self.stream_interval,
        )
        if self.constraints is not None:
            settings.harness_constraints = self.constraints.mode
            settings.think_markers = self.constraints.markers
        return settings

    def _refuse(
        self, flow: http.HTTPFlow, dialect: Dialect, record: CallRecord, e: DialectError
    ) -> None:
        flow.response = http.Response.make(
            e.status,
            dialect.error_bytes(e.status, e.message, e.kind),
            {"content-type": "application/json"},
        )
        record.http_status = e.status
        record.finished_at = now_us()
        record.status, record.error, record.ids_source = "error", e.message, "none"
        deliver(record, self.sinks)

    async def _answer_locally(
        self, flow: http.HTTPFlow, dialect: Dialect, req: HarnessRequest, record: CallRecord
    ) -> None:
        """A request the dialect answers itself (e.g. count_tokens): no upstream call; the
        record says route=local and has no ids, so it never enters a trace."""
        assert self.upstream is not None
        tok = self.tokenizer.tokenizer if self.tokenizer is not None else None
        counter = PromptCounter(tok, self.upstream.template_flavor)
        record.route = "local"
        try:
            reply = await asyncio.to_thread(dialect.local_reply, req, counter)
        except DialectError as e:
            self._refuse(flow, dialect, record, e)
            return
        except Exception as e:  # a tokenizer failure must still answer and leave a record
            log.exception("polar-mitm: local answer for call %s failed", record.call_id)
            self._refuse(
                flow, dialect, record, DialectError(f"polar-mitm: {e}", 500, "server_error")
            )
            return
        body = json.dumps(reply).encode()
        flow.response = http.Response.make(200, body, {"content-type": "application/json"})
        record.http_status = 200
        record.first_byte_at = record.finished_at = now_us()
        record.status, record.ids_source = "completed", "none"
        record.response_json = json.dumps(reply)
        deliver(record, self.sinks)

    def _call_done(self, call: Call) -> None:
        if self.metrics is not None:
            self.metrics.added_latency(call)
        self.live.pop(call.record.call_id, None)
        self.gateway.drop(call.record.call_id)
        if call.record.http_status == 404 and not ctx.options.polar_model:
            # The model found in GET /v1/models is gone (the server was redeployed under another
            # name): ask again on the next call instead of failing every call from now on.
            self.served_model = None

    def _other_path(self, flow: http.HTTPFlow) -> None:
        if ctx.options.polar_other_paths == "pass":
            _drop_polar_keys(flow.request)
            return
        flow.response = _json_response(
            404,
            {
                "error": {
                    "message": f"polar-mitm answers only LLM endpoints on {flow.request.host}; "
                    f"{flow.request.method} {flow.request.path.partition('?')[0]} is not one",
                    "type": "not_found_error",
                }
            },
        )

    async def _probe_kind(self, announce: bool = False) -> None:
        """polar_upstream_kind=auto: ask GET /v1/models once who answers, and say so in one line."""
        async with self._probe_lock:
            await self._probe_kind_once(announce)

    async def _probe_kind_once(self, announce: bool) -> None:
        base = self.auto_base
        if base is None or self.gateway.session is None:
            return
        try:
            async with self.gateway.session.get(
                base + "/v1/models", timeout=aiohttp.ClientTimeout(total=3)
            ) as r:
                data = await r.json(content_type=None)
        except Exception as e:
            if announce:
                log.warning(
                    "polar-mitm: polar_upstream_kind=auto: %s cannot be probed yet (%s); "
                    "probing again on the first call",
                    base,
                    e or type(e).__name__,
                )
            return
        kind, evidence = kind_from_models(data)
        self.upstream = UPSTREAMS[kind](base)
        self.auto_base = None
        log.info("polar-mitm: polar_upstream_kind=auto: %s is %s (%s)", base, kind, evidence)

    async def _served_model(self, announce: bool = False) -> str | None:
        """polar_model, or the first model the server lists (asked until it answers); its
        `max_model_len` on the way (exact-prefix mode caps token-in outputs with it)."""
        known = self.served_model and (
            self.max_model_len or self.exact is None or not self.exact.book
        )
        if known or self.upstream is None or self.gateway.session is None:
            return self.served_model
        url = self.upstream.base_url + "/v1/models"
        try:
            async with self.gateway.session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
                data = await r.json(content_type=None)
            cards = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
            models = [m["id"] for m in cards]
        except Exception as e:
            if announce:
                log.warning(
                    "polar-mitm: upstream %s is not reachable yet (%s): calls get a 502 naming it "
                    "until it is",
                    self.upstream.base_url,
                    e or type(e).__name__,
                )
            return self.served_model
        self.served_model = self.served_model or (models[0] if models else None)
        card = next((c for c in cards if c["id"] == self.served_model), None)
        limit = card.get("max_model_len") if card is not None else None
        self.max_model_len = limit if isinstance(limit, int) and limit > 0 else None
        return self.served_model
