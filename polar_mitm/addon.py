"""polar-mitm's mitmproxy addons: their options and hooks. The work is in the modules they call.

One class per concern, composed in `addons/polar.py`:
- `ProxySetup`: the proxy settings polar-mitm needs (lazy connections, CA in certs/, loopback);
- `RolloutIdentityAddon`: remembers proxy credentials per client connection;
- `TokenizerAddon`: loads the policy tokenizer (`polar_tokenizer`);
- `RetokenizeAddon`: the no-ids fallback built on it (`polar_trust_retokenized`);
- `ExactPrefixAddon`: exact-prefix mode (`polar_exact_prefix`): chains' exact tokens as prompts;
- `FidelityAddon`: token fidelity checks of every call (`polar_fidelity`), between the merge
  and the store;
- `StoreAddon`: the journal and Parquet shards under `polar_output`;
- `CaptureAddon`: detects LLM calls on `polar_hosts`, sends them to the policy server through the
  in-process gateway, answers the other paths of those hosts;
- `TrajectoryAddon`: merges each rollout's calls into traces, writes them when the rollout ends;
- `ControlAddon`: the trainer's control plane (`control.py`) on a reserved host and/or a port;
- `MetricsAddon` (`metrics.py`): Prometheus ``/metrics`` on the control port;
- `TokenizerRecordAddon` (`tokenizer_record.py`): records `polar_tokenizer` with the shards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import json
import logging
import re
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from mitmproxy import connection, ctx, exceptions, http

from .capture import (
    REDACTED,
    SECRET_HEADERS,
    CallRecord,
    CallSink,
    deliver,
    now_us,
    redact_headers,
    redacted_json,
    scrub,
    secret_values,
)
from .certs import DEFAULT_CONFDIR
from .control import DEFAULT_HOST, ControlAPI, ControlServer, ControlState, encode, parse_listen
from .dialects import Dialect, DialectError, HarnessRequest, detect
from .exact_prefix import ExactPrefix
from .exchange import Call, UpstreamSettings
from .fidelity import PolicyTokenizer, TokenizerError, load_tokenizer
from .fidelity_check import MODES as FIDELITY_MODES
from .fidelity_check import FidelityStage
from .fidelity_check import describe as describe_fidelity
from .gateway import Gateway
from .identity import API_KEY_PREFIX, RolloutIdentity, api_key, proxy_user, resolve
from .lineage import agent_of
from .metrics import MetricsAddon, ProxyMetrics
from .output_parsers import FAMILIES, family
from .retokenize import Retokenizer
from .rollouts import Rollouts
from .store import Store
from .tokencount import PromptCounter
from .tokenizer_record import TokenizerRecordAddon
from .trajectory import ALLOW_CHOICES
from .upstream import UPSTREAMS, Upstream, kind_from_models

log = logging.getLogger("polar_mitm")
# ab.chatgpt.com is Codex's telemetry (OpenTelemetry metrics, docs/harness-wire-notes.md): it has
# no LLM endpoint, so listing it answers all of it locally and no rollout leaks telemetry.
DEFAULT_HOSTS = "api.openai.com,api.anthropic.com,chatgpt.com,ab.chatgpt.com"
_RAW_BODY_LIMIT = 1 << 20
# A harness (or a test) may say what a call is for; anything but "main" is a side call.
PURPOSE_HEADER = "x-polar-purpose"
_PURPOSE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class _StartupErrors:
    """Option errors: at start-up one logged line (mitmdump then exits 1, no traceback);
    later, when a user changes an option at runtime, mitmproxy's usual OptionsError."""

    running = False

    def fail(self, message: str) -> None:
        if self.running:
            raise exceptions.OptionsError(message)
        log.error(message)


_errors = _StartupErrors()


def _seconds(name: str, value: str, *, zero_ok: bool = True) -> float | None:
    """A duration option. They are str options: mitmproxy's `--set` cannot parse floats."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (0 < seconds < float("inf") or zero_ok and seconds == 0):
        _errors.fail(f"{name}: {value!r} is not a number of seconds")
        return None
    return seconds


def _forget_secrets(flow: http.HTTPFlow) -> None:
    """A flow answered here goes nowhere: drop its credentials, so that mitmproxy's own output
    (flow_detail 3+, `-w` flow files) and other addons never see them."""
    headers = flow.request.headers
    values = secret_values(headers)
    for name in SECRET_HEADERS:
        headers.pop(name, None)
    content = flow.request.raw_content
    if values and content:
        for value in values:
            content = content.replace(value.encode(), REDACTED.encode())
        flow.request.raw_content = content


def _json_response(status: int, obj: object) -> http.Response:
    return http.Response.make(status, json.dumps(obj), {"content-type": "application/json"})


class ProxySetup:
    """Settings a capture proxy needs, so that users do not have to know them."""

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy != "lazy":
            # The default dials the real host at CONNECT time: with no internet that is a 502
            # before any hook runs, and captured hosts are never dialed at all.
            ctx.options.connection_strategy = "lazy"
        if "confdir" in updated and ctx.options.confdir == "~/.mitmproxy":
            ctx.options.confdir = str(DEFAULT_CONFDIR)
        if "listen_host" in updated and ctx.options.listen_host == "":
            ctx.options.listen_host = "127.0.0.1"
        if (
            "listen_host" in updated
            and not _is_loopback(ctx.options.listen_host)
            and not ctx.options.proxyauth
        ):
            log.warning(
                "polar-mitm: listening on %s without proxy authentication: anyone who can reach "
                "this port can use the proxy (set proxyauth, or listen on 127.0.0.1)",
                ctx.options.listen_host or "all interfaces",
            )

    async def running(self) -> None:
        _errors.running = True
        await self._rebind_on_loopback()

    async def _rebind_on_loopback(self) -> None:
        """mitmdump loads `-s` scripts concurrently with binding its servers, so they may already
        listen on all interfaces (listen_host "") when `configure` sets 127.0.0.1. Rebind them:
        the default must be loopback, whatever the start-up order."""
        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is None or not _is_loopback(ctx.options.listen_host):
            return
        wide = [a for a in proxyserver.listen_addrs() if not _is_loopback(str(a[0]))]
        if not wide:
            return
        await proxyserver.servers.update([])
        await proxyserver.setup_servers()
        log.info(
            "polar-mitm: listening on %s only (--listen-host to change)", ctx.options.listen_host
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RolloutIdentityAddon:
    """Rule 1 of rollout identity: proxy credentials, kept per client connection."""

    def __init__(self) -> None:
        self._users: weakref.WeakKeyDictionary[connection.Client, str] = weakref.WeakKeyDictionary()

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._remember(flow)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Plain-HTTP proxying sends the credentials with every request: take them, never forward.
        self._remember(flow)

    def _remember(self, flow: http.HTTPFlow) -> None:
        header = flow.request.headers.pop("proxy-authorization", None)
        user = proxy_user(header)
        if user:
            self._users[flow.client_conn] = user

    def identify(self, flow: http.HTTPFlow) -> RolloutIdentity:
        peer = flow.client_conn.peername
        host = str(peer[0]) if peer else "unknown"
        return resolve(flow.request.headers, host, self._users.get(flow.client_conn))


class TokenizerAddon:
    def __init__(self) -> None:
        self.tokenizer: PolicyTokenizer | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_tokenizer",
            str,
            "",
            "Policy tokenizer for fidelity checks and count_tokens: a local Hugging Face tokenizer "
            "dir (with its chat template), tiktoken:<encoding name or .tiktoken file>, or "
            "gguf:<model.gguf> (the tokenizer and chat template inside a GGUF model file).",
        )

    def configure(self, updated: set[str]) -> None:
        if "polar_tokenizer" not in updated:
            return
        spec = ctx.options.polar_tokenizer
        if not spec:
            self.tokenizer = None
            return
        try:
            self.tokenizer = load_tokenizer(spec)
        except TokenizerError as e:
            _errors.fail(f"polar_tokenizer: {e}")


class FidelityAddon:
    """`polar_fidelity`: each finished call is merged into its rollout, checked against the
    policy tokenizer off the event loop, then stored (see fidelity_check.py)."""

    def __init__(self, tokenizer: TokenizerAddon, stage: FidelityStage) -> None:
        self.tokenizer = tokenizer
        self.stage = stage

    def load(self, loader) -> None:
        loader.add_option(
            "polar_fidelity",
            str,
            "check",
            "Token fidelity checks of each call against polar_tokenizer, after the harness has "
            "its reply: off; check (flag bpe_resplit, template_rerender, reasoning_dropped, "
            "tool_args_reserialized, special_tokens, count_mismatch in fidelity_flags, with "
            "positions in fidelity_json); strict (also mark every trace of a rollout with a "
            "drift not trainable).",
        )

    def configure(self, updated: set[str]) -> None:
        if not {"polar_fidelity", "polar_tokenizer"} & updated:
            return
        mode = ctx.options.polar_fidelity.strip().lower()
        if mode not in FIDELITY_MODES:
            _errors.fail(
                f"polar_fidelity: {ctx.options.polar_fidelity!r} is not one of "
                f"{', '.join(FIDELITY_MODES)}"
            )
            return
        self.stage.configure(mode, self.tokenizer.tokenizer)

    def running(self) -> None:
        log.info("polar-mitm: %s", describe_fidelity(self.stage.mode, self.stage.tokenizer))

    def call_finished(self, record: CallRecord) -> Any:
        return self.stage.call_finished(record)  # the store's receipt, after the checks

    async def done(self) -> None:
        # Runs after the capture and the no-ids fallback have handed over their last records
        # and before the trajectories write the open rollouts (addon order).
        await self.stage.drain()
        self.stage.close()


class RetokenizeAddon:
    """The fallback for servers that return no token ids: ids recomputed with polar_tokenizer,
    checked against the server's usage and flagged (see retokenize.py)."""

    def __init__(self, tokenizer: TokenizerAddon) -> None:
        self.tokenizer = tokenizer
        self.retokenizer: Retokenizer | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_trust_retokenized",
            bool,
            False,
            "Mark records whose ids were recomputed with polar_tokenizer (the server returned "
            "none) trainable when both token counts match the server's usage. Off: such records "
            "are kept but never trainable, since retokenized text need not be what was sampled.",
        )

    def configure(self, updated: set[str]) -> None:
        if not {"polar_tokenizer", "polar_trust_retokenized"} & updated:
            return
        tok = self.tokenizer.tokenizer
        self.retokenizer = (
            Retokenizer(tok, trust=ctx.options.polar_trust_retokenized) if tok is not None else None
        )

    def describe(self) -> str:
        """One phrase for the start-up line."""
        r = self.retokenizer
        if r is None:
            return "no-ids fallback off (no polar_tokenizer)"
        if not r.available:
            return f"no-ids fallback off ({r.tokenizer.spec} has no chat template)"
        trust = ", trusted" if r.trust else ""
        return f"no-ids fallback: retokenize with {r.tokenizer.spec}{trust}"

    async def drain(self) -> None:
        if self.retokenizer is not None:
            await self.retokenizer.drain()

    async def done(self) -> None:
        # Runs before StoreAddon.done (addon order): records still being retokenized must reach
        # the store before it closes.
        await self.drain()


class ExactPrefixAddon:
    """`polar_exact_prefix`: a call that extends one of its rollout's chains is sent to the
    server's token-in endpoint with the chain's exact tokens as its prompt (exact_prefix.py)."""

    def __init__(self, tokenizer: TokenizerAddon) -> None:
        self.tokenizer = tokenizer
        self.book: ExactPrefix | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_exact_prefix",
            bool,
            False,
            "Exact-prefix mode: a call that extends one of its rollout's chains gets the chain's "
            "exact tokens (as sampled) plus only its new messages rendered with polar_tokenizer's "
            "chat template as its prompt, sent to the server's token-in endpoint (vLLM "
            "/v1/completions, SGLang /generate); the raw reply is parsed back into the harness's "
            "dialect with polar_output_parser. Other calls go the chat way. Needs polar_tokenizer "
            "with a chat template.",
        )
        loader.add_option(
            "polar_output_parser",
            str,
            "qwen3",
            "Exact-prefix mode: the policy's output format, to turn raw generated text into "
            f"reasoning, content and tool calls ({', '.join(FAMILIES)}).",
        )

    def configure(self, updated: set[str]) -> None:
        if not {"polar_exact_prefix", "polar_output_parser", "polar_tokenizer"} & updated:
            return
        self.book = None
        opts = ctx.options
        try:
            parser = family(opts.polar_output_parser)
        except ValueError as e:
            _errors.fail(f"polar_output_parser: {e}")
            return
        if not opts.polar_exact_prefix:
            return
        tok = self.tokenizer.tokenizer
        if tok is None or not tok.has_chat_template:
            _errors.fail(
                "polar_exact_prefix: needs polar_tokenizer set to a tokenizer with a chat template "
                "(a Hugging Face tokenizer dir or gguf:FILE), to render new messages as the server "
                "would"
            )
            return
        self.book = ExactPrefix(tok, parser)

    def running(self) -> None:
        if self.book is not None:
            log.info(
                "polar-mitm: exact-prefix mode on (chains rendered with %s, output parser %s)",
                self.book.tokenizer.spec,
                self.book.family.name,
            )

    def rollout_written(self, rollout_id: str) -> None:
        if self.book is not None:
            self.book.forget(rollout_id)

    async def drain(self) -> None:
        if self.book is not None:
            await self.book.drain()


class StoreAddon:
    """Every finished call goes to the journal (fsynced) and from there into Parquet shards."""

    def __init__(self) -> None:
        self.store: Store | None = None
        self._started = False

    def load(self, loader) -> None:
        loader.add_option(
            "polar_output",
            str,
            "./polar-data",
            "Where captured calls and traces go: a local dir, or a URI such as "
            "s3://BUCKET/PREFIX?endpoint_override=HOST:PORT&scheme=http&region=R (credentials from "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, never in the URI; see "
            "docs/store.md).",
        )
        loader.add_option(
            "polar_journal",
            str,
            "",
            "Local journal dir (default: <polar_output>/_journal; required for remote output: one "
            "per proxy).",
        )
        loader.add_option("polar_flush_rows", int, 512, "Write a shard after this many rows.")
        loader.add_option(
            "polar_flush_seconds",
            str,
            "30",
            "Write a shard once its oldest row is this many seconds old (a number, e.g. 30 or 0.5).",
        )
        loader.add_option(
            "polar_durable_replies",
            bool,
            True,
            "Hold the last event of each completed reply (e.g. data: [DONE]) until the call's "
            "record is fsynced in the journal, so a reply a harness saw complete is never lost "
            "to a crash. Costs about one group-committed fsync per call.",
        )

    def configure(self, updated: set[str]) -> None:
        keys = {"polar_output", "polar_journal", "polar_flush_rows", "polar_flush_seconds"}
        if not keys & updated or self._started:
            return
        opts = ctx.options
        try:
            self.store = Store(
                output=opts.polar_output,
                journal_dir=opts.polar_journal or None,
                flush_rows=opts.polar_flush_rows,
                flush_age_s=_seconds("polar_flush_seconds", opts.polar_flush_seconds, zero_ok=False)
                or 30.0,
            )
        except (ValueError, OSError) as e:
            _errors.fail(f"polar_output: {e}")

    def running(self) -> None:
        if self.store is None or self._started:
            return
        try:
            report = self.store.start()
        except (RuntimeError, OSError) as e:  # e.g. another proxy holds this journal dir
            log.error("polar_output: %s", e)
            self.store = None
            return
        self._started = True
        log.info("polar-mitm: writing to %s (%s)", self.store.display_output, report)

    def done(self) -> None:
        if self.store is not None and self._started:
            self.store.close()
            self._started = False

    def call_finished(self, record: CallRecord) -> concurrent.futures.Future[bool] | None:
        """Journal the record; the receipt (when polar_durable_replies) is done once fsynced."""
        if self.store is None:
            return None
        record.proxy_id = self.store.proxy_id
        seq = self.store.append("calls", record.to_row())
        if seq and self._started and ctx.options.polar_durable_replies:
            return self.store.journaled(seq)
        return None


class CaptureAddon:
    def __init__(
        self,
        identity: RolloutIdentityAddon,
        sinks: Sequence[CallSink],
        retokenize: RetokenizeAddon | None = None,
        control: ControlState | None = None,
        tokenizer: TokenizerAddon | None = None,
        exact: ExactPrefixAddon | None = None,
    ) -> None:
        self.identity = identity
        self.exact = exact
        self.sinks = list(sinks)
        self.stall_timeout = 300.0
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
        self.metrics: ProxyMetrics | None = None  # observes each call's added latency

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
        if "polar_hosts" in updated:
            self.hosts = frozenset(
                h.strip().lower() for h in opts.polar_hosts.split(",") if h.strip()
            )
        if "polar_other_paths" in updated and opts.polar_other_paths not in ("answer", "pass"):
            _errors.fail(f"polar_other_paths: {opts.polar_other_paths!r} is not 'answer' or 'pass'")
        if "polar_model" in updated:
            self.served_model = opts.polar_model or None

    async def running(self) -> None:
        await self.gateway.start(self.connect_timeout, self.stall_timeout)
        if self.auto_base is not None:
            await self._probe_kind(announce=True)
        model = await self._served_model(announce=True)
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
        assert self.upstream is not None
        identity = self.identity.identify(flow)
        headers = flow.request.headers
        secrets = secret_values(headers)
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
        record.headers_json = scrub(json.dumps(redact_headers(headers.items(multi=True))), secrets)
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
            req = dialect.parse(body, path)
            request_json = redacted_json(req.body, secrets)
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
            return
        record.request_json = request_json
        record.stream = req.stream
        record.model_requested = req.model
        purpose = headers.get(PURPOSE_HEADER, "").strip().lower()
        record.purpose = purpose if _PURPOSE.match(purpose) else req.purpose
        record.agent = agent_of(headers)
        record.translation_notes = list(req.notes)
        if req.local:
            await self._answer_locally(flow, dialect, req, record)
            return
        book = self.exact.book if self.exact is not None else None
        if book is not None:
            book.flavor = self.upstream.template_flavor  # known only now with kind auto
        settings = UpstreamSettings(
            self.upstream,
            await self._served_model(),
            self.connect_timeout,
            self.stall_timeout,
            self.retokenize.retokenizer if self.retokenize is not None else None,
            book,
            self.max_model_len,
        )
        call = Call(record, dialect, req, settings, self.sinks, secrets, self._call_done)
        self.live[record.call_id] = call
        if self.control is not None:
            self.control.call_started(record.call_id, record.rollout_id)
        gateway_path = self.gateway.register(call)
        assert self.gateway.port is not None
        flow.metadata["polar_call"] = record.call_id
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = self.gateway.port
        flow.request.path = gateway_path
        flow.request.method = "POST"
        flow.request.headers = http.Headers(
            host=f"127.0.0.1:{self.gateway.port}", content_length="0"
        )
        flow.request.content = b""

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
            key = api_key(flow.request.headers)
            if key and key.startswith(API_KEY_PREFIX):
                for name in ("authorization", "x-api-key", "api-key"):
                    flow.request.headers.pop(name, None)
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


class TrajectoryAddon:
    """Each rollout's calls, prefix-merged into chains (`trajectory.py`); their `traces/` rows
    are written when the rollout ends: by the control plane, after `polar_rollout_idle`
    seconds without a call, or at shutdown (as `incomplete`)."""

    def __init__(
        self, store: StoreAddon, control: ControlState, exact: ExactPrefixAddon | None = None
    ) -> None:
        self.store = store
        self.control = control
        self.exact = exact
        self.rollouts = Rollouts(self._write)
        self.idle_s = 0.0
        self._idle_task: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_rollout_idle",
            str,
            "0",
            "End a rollout (status completed, no reward) after this many seconds without a call "
            "and none in flight; its traces are written then. 0: only the control plane or "
            "shutdown end rollouts. A reward sent later writes a new revision of its traces.",
        )
        loader.add_option(
            "polar_train_allow",
            str,
            "",
            "Comma-separated rollout conditions that do not make its traces untrainable: "
            "policy_mixed (its calls ran under several policy versions), call_error (one of its "
            "calls failed). Retokenized ids: see polar_trust_retokenized.",
        )
        loader.add_option(
            "polar_keep_ended",
            int,
            64,
            "Ended rollouts kept in memory for the control plane (listing, traces, late rewards).",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "polar_train_allow" in updated:
            allow = frozenset(a.strip() for a in opts.polar_train_allow.split(",") if a.strip())
            unknown = sorted(allow - set(ALLOW_CHOICES))
            if unknown:
                _errors.fail(
                    f"polar_train_allow: unknown {', '.join(unknown)} "
                    f"(choose from {', '.join(ALLOW_CHOICES)})"
                )
            else:
                self.rollouts.allow = allow
        if "polar_keep_ended" in updated:
            if opts.polar_keep_ended < 0:
                _errors.fail("polar_keep_ended: must be 0 or more")
            else:
                self.rollouts.keep_ended = opts.polar_keep_ended
        if "polar_rollout_idle" in updated:
            idle = _seconds("polar_rollout_idle", opts.polar_rollout_idle or "0")
            if idle is not None:
                self.idle_s = idle

    def running(self) -> None:
        if self.store.store is not None:
            self.rollouts.proxy_id = self.store.store.proxy_id
        if self._idle_task is None:
            self._idle_task = asyncio.get_running_loop().create_task(self._end_idle())

    def done(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            self._idle_task = None
        written = self.rollouts.close()
        if written:
            log.info("polar-mitm: wrote %d open rollout(s) as incomplete", written)

    def call_finished(self, record: CallRecord) -> None:
        self.rollouts.call_finished(record)

    def _write(self, rows: list[dict]) -> None:
        if self.store.store is not None:
            for row in rows:
                self.store.store.append("traces", row)
        if self.exact is not None:  # an ended rollout's chains are not needed any more
            for rollout_id in {row.get("rollout_id") for row in rows}:
                self.exact.rollout_written(str(rollout_id))

    async def _end_idle(self) -> None:
        while True:
            idle = self.idle_s
            await asyncio.sleep(min(max(idle / 4, 0.05), 1.0) if idle > 0 else 1.0)
            if idle > 0 and not self.control.paused:  # calls may be waiting at the pause
                try:
                    self.rollouts.end_idle(idle, self.control.busy, self.control.resumed_at)
                except Exception:  # a bug here must not stop later checks
                    log.exception("polar-mitm: ending idle rollouts failed")


class ControlAddon:
    """The control plane: requests to `polar_control_host` through the proxy are answered here,
    and `polar_control_listen` opens a port of its own. Refused unless `polar_control_token`."""

    def __init__(
        self,
        state: ControlState,
        rollouts: Rollouts,
        settle: Callable[[], Awaitable[None]] | None = None,
        metrics: MetricsAddon | None = None,
    ) -> None:
        self.state = state
        self.metrics = metrics  # GET /metrics on polar_control_listen
        self.api = ControlAPI(state, rollouts, settle)
        self.host = DEFAULT_HOST
        self.listen: tuple[str, int] | None = None
        self.server: ControlServer | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_control_token",
            str,
            "",
            "Bearer token for the control plane (end rollouts with a reward, policy version, "
            "pause/resume). Without it the control plane refuses every request.",
        )
        loader.add_option(
            "polar_control_host",
            str,
            DEFAULT_HOST,
            "Reserved host name of the control plane through the proxy: "
            "http://<this host>/v1/... via HTTP(S)_PROXY is answered by the proxy itself.",
        )
        loader.add_option(
            "polar_control_listen",
            str,
            "",
            "Also serve the control plane on this port of its own: PORT or HOST:PORT "
            "(host default 127.0.0.1). Empty: only through the proxy.",
        )
        loader.add_option(
            "polar_policy_version",
            str,
            "",
            "Policy version stamped on calls until the control plane sets another.",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "polar_control_token" in updated:
            self.api.token = opts.polar_control_token
        if "polar_control_host" in updated:
            self.host = opts.polar_control_host.strip().lower() or DEFAULT_HOST
        if "polar_policy_version" in updated:
            self.state.policy_version = opts.polar_policy_version or None
        if "polar_control_listen" in updated:
            self.listen = None
            if opts.polar_control_listen:
                try:
                    self.listen = parse_listen(opts.polar_control_listen)
                except ValueError as e:
                    _errors.fail(f"polar_control_listen: {e}")

    async def running(self) -> None:
        if self.listen is not None and self.server is None:
            self.server = ControlServer(self.api, self.metrics)
            try:
                url = await self.server.start(*self.listen)
            except OSError as e:
                log.error("polar-mitm: polar_control_listen: cannot listen: %s", e)
                self.server = None
                return
            log.info("polar-mitm: control plane listening on %s", url)
        if not self.api.token:
            log.info("polar-mitm: control plane off (no polar_control_token)")

    async def done(self) -> None:
        self.state.shutdown()  # calls waiting at a pause get a 503 instead of hanging
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.host.lower() != self.host:
            return
        status, obj = await self.api.handle(
            flow.request.method,
            flow.request.path,
            flow.request.headers,
            flow.request.get_content(strict=False) or b"",
        )
        body, headers = encode(status, obj)
        flow.response = http.Response.make(status, body, headers)


def polar_addons() -> list[object]:
    """The addons of `mitmdump -s addons/polar.py`, wired together. The control state is the
    first sink: it stamps `policy_version_end` before the store and the trajectories see a call."""
    identity = RolloutIdentityAddon()
    tokenizer = TokenizerAddon()
    retokenize = RetokenizeAddon(tokenizer)
    exact = ExactPrefixAddon(tokenizer)
    store = StoreAddon()
    state = ControlState()
    trajectory = TrajectoryAddon(store, state, exact)
    # merge, then fidelity checks (worker), then the store and the metrics (final records)
    metrics = MetricsAddon(state, trajectory.rollouts, store)
    stage = FidelityStage(trajectory.rollouts, [store, metrics])
    fidelity = FidelityAddon(tokenizer, stage)
    capture = CaptureAddon(
        identity,
        sinks=[state, fidelity],
        retokenize=retokenize,
        control=state,
        tokenizer=tokenizer,
        exact=exact,
    )
    capture.metrics = metrics.metrics
    control = ControlAddon(state, trajectory.rollouts, settle=stage.drain, metrics=metrics)
    # Order matters at shutdown: `done` runs in list order, so the capture finishes its in-flight
    # calls, then pending retokenizations and fidelity checks drain, the trajectories write the
    # open rollouts, and only then does the store close.
    return [
        ProxySetup(),
        identity,
        tokenizer,
        exact,
        control,
        capture,
        retokenize,
        fidelity,
        trajectory,
        store,
        metrics,
        TokenizerRecordAddon(tokenizer, store),  # after the store has started
    ]
