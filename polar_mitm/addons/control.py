"""`ControlAddon`: the trainer's control plane (`control.py`) on a reserved host and/or a port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mitmproxy import ctx, http

from ..control import DEFAULT_HOST, ControlAPI, ControlServer, ControlState, encode, parse_listen
from ..control_client import control_token
from ..metrics import MetricsAddon
from ..trajectory.rollouts import Rollouts
from ..upstream.weights import ENGINES
from .options import _errors, log


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
            "pause/resume). Empty: $POLAR_CONTROL_TOKEN, else the file $POLAR_CONTROL_TOKEN_FILE "
            "names (neither shows in `ps`). Without any, the control plane refuses every request.",
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

        loader.add_option(
            "polar_engine",
            str,
            "",
            "The engine POST /v1/weights pushes checkpoints into: vllm-dev (a vLLM started with "
            "VLLM_SERVER_DEV_MODE=1, on loopback). Empty: weight pushes are refused.",
        )
        loader.add_option(
            "polar_engine_url",
            str,
            "",
            "The engine's base URL for weight pushes (default: polar_upstream).",
        )
        loader.add_option(
            "polar_engine_weights",
            str,
            "",
            "The checkpoint folder the engine serves at start: the reference a pushed "
            "checkpoint is checked against, and the last good weights to go back to.",
        )
        loader.add_option(
            "polar_engine_restart",
            str,
            "",
            "Command that starts the engine again (in the background, then returns) when it "
            "died on a reload; POLAR_WEIGHTS holds the last good folder.",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        engine_opts = {"polar_engine", "polar_engine_url", "polar_engine_restart", "polar_upstream"}
        if updated & engine_opts:
            self.api.engine = None
            kind = opts.polar_engine.strip()
            if kind and kind not in ENGINES:
                _errors.fail(f"polar_engine: {kind!r} is not one of {', '.join(ENGINES)}")
            elif kind:
                url = opts.polar_engine_url or getattr(opts, "polar_upstream", "")
                if not url.startswith(("http://", "https://")):
                    _errors.fail(
                        "polar_engine: set polar_engine_url (or polar_upstream) to its URL"
                    )
                else:
                    self.api.engine = ENGINES[kind](url, restart=opts.polar_engine_restart)
        if "polar_engine_weights" in updated:
            self.api.weights = opts.polar_engine_weights or None
        if "polar_control_token" in updated:
            try:
                self.api.token = opts.polar_control_token or control_token()
            except ValueError as e:
                _errors.fail(f"polar_control_token: {e}")
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
