"""The control plane: what a trainer tells the proxy, over HTTP on the proxy itself.

Two ways in, one API (`ControlAPI`):

- through the proxy, on the reserved host ``polar_control_host`` (default ``polar.control``):
  ``curl -x http://proxy:8080 -H "Authorization: Bearer $TOKEN" http://polar.control/v1/status``;
  mitmproxy answers it locally, nothing leaves the proxy (HTTPS works too, with the proxy's CA);
- on a port of its own, when ``polar_control_listen`` is set (``127.0.0.1:8099``).

Every request needs ``Authorization: Bearer <polar_control_token>`` (or ``x-polar-control-token``),
compared in constant time; without a configured token the control plane refuses everything (403),
with a wrong or missing one it answers 401 and changes nothing. Endpoints (JSON in, JSON out)::

    GET  /v1/status                      paused, policy version, calls in flight / waiting
    GET  /v1/policy                      {"policy_version"}
    POST /v1/policy {"version": "s12"}   stamp every later call with this version
    POST /v1/pause {"wait_s": 30}        new LLM calls wait; optionally wait for in-flight ones
    POST /v1/resume                      let waiting calls go
    GET  /v1/rollouts[?group=G&state=open|ended]
    GET  /v1/groups                      GRPO groups with their samples
    GET  /v1/rollouts/{id}               one rollout's summary
    GET  /v1/rollouts/{id}/traces        its traces as JSON (a snapshot while open)
    POST /v1/rollouts/{id}/end {"reward": 1.0, "status": "completed"}
    GET  /v1/weights                     the weights the engine serves, and its own word on them
    POST /v1/weights {"path": "/abs/ckpt", "version": "step-3", "wait_s": 120}
                                         push a checkpoint into the engine (`push_weights`)
    GET  /metrics                        Prometheus text format (the port only; metrics.py):
                                         no token needed when polar_metrics_public

`ControlClient` is the trainer's side of it (standard library only, in `control_client.py`,
re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from aiohttp import web

from .control_client import DEFAULT_HOST, ControlClient, ControlError
from .trajectory.rollouts import RolloutError, Rollouts
from .upstream.weights import Engine, EngineFailed, WeightsRefused, check_checkpoint

if TYPE_CHECKING:  # metrics.py imports prometheus_client: only when a proxy serves /metrics
    from .core.record import CallRecord  # (and the store it imports: not in NeMo Gym's venv)
    from .metrics import MetricsAddon

log = logging.getLogger(__name__)
__all__ = ["DEFAULT_HOST", "ControlClient", "ControlError"]  # the client, re-exported
TOKEN_HEADER = "x-polar-control-token"
_BODY_LIMIT = 1 << 20

SETTLE_S = 10.0  # at most this long for pending checks before a rollout ends
# What ending a rollout with no captured call answers (404): the harness never reached the
# proxy, and a trainer that scored its workdir anyway would train on nothing.
ENDED_EMPTY = (
    "rollout {id!r} ended with zero captured calls: its harness never went through the proxy "
    "(proxy variables not honoured, a base URL that bypasses the proxy, or NO_PROXY covering "
    'the model\'s host; see docs/harnesses.md, "A rollout that captured nothing"); '
    "nothing was recorded to train on"
)


class ControlState:
    """Policy version, the pause gate, and the calls in flight: shared by the capture path
    (which waits at the gate and stamps the version) and the control API.

    It is also the first step of the call's pipeline (`addons/pipeline.py`): it stamps
    `policy_version_end` on each finished record before the store and the trajectories see it. (A call's own `trainable`
    stays the capture path's verdict on its tokens; the traces of a rollout whose calls span
    two versions are marked untrainable, see `trajectory.untrainable_reasons`.)
    """

    def __init__(self, policy_version: str | None = None) -> None:
        self.policy_version = policy_version
        self._open = asyncio.Event()
        self._open.set()
        self._closed = False
        self.waiting = 0
        self.resumed_at = 0.0  # time.monotonic() of the last resume: idle clocks restart there
        self.in_flight: dict[str, str] = {}  # call_id -> rollout_id
        self.ended_empty = 0  # ends asked for rollouts without a captured call (/metrics)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def admit(self) -> bool:
        """Wait while paused; False when the proxy shuts down instead."""
        if not self._open.is_set():
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        return not self._closed

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> int:
        waiting = self.waiting
        if not self._open.is_set():
            self.resumed_at = time.monotonic()
        self._open.set()
        return waiting

    def shutdown(self) -> None:
        self._closed = True
        self._open.set()

    def call_started(self, call_id: str, rollout_id: str) -> None:
        self.in_flight[call_id] = rollout_id
        self._idle.clear()

    def call_finished(self, record: CallRecord) -> None:
        record.policy_version_end = self.policy_version
        if self.in_flight.pop(record.call_id, None) is not None and not self.in_flight:
            self._idle.set()

    def busy(self, rollout_id: str) -> bool:
        return rollout_id in self.in_flight.values()

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the calls in flight to finish."""
        if not self.in_flight:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "policy_version": self.policy_version,
            "in_flight": len(self.in_flight),
            "waiting": self.waiting,
        }


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _StayPaused(_Refused):
    """A failed push after which the engine is not serving: waiting calls keep waiting."""


class ControlAPI:
    """Routes one control request; transport-free so both ways in share it."""

    def __init__(
        self,
        state: ControlState,
        rollouts: Rollouts,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.state = state
        self.rollouts = rollouts
        self.token = ""
        # Awaited before a rollout ends: work still running on its finished calls (the fidelity
        # checks) lands first, so the traces written at the end are final (one revision).
        self.settle = settle
        # the engine a weight push goes into (polar_engine), and the folder it serves now
        self.engine: Engine | None = None
        self.weights: str | None = None
        self._push_lock = asyncio.Lock()

    async def handle(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) for a request; `target` is the raw path with its query."""
        try:
            self._authorize(headers)
            path, _, query = target.partition("?")
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:1] != ["v1"] or len(parts) < 2:
                raise _Refused(404, f"no control endpoint {path!r} (they are under /v1/)")
            return 200, await self._route(method.upper(), parts[1:], parse_qs(query), body)
        except _Refused as e:
            return e.status, {"error": {"message": e.message, "status": e.status}}
        except RolloutError as e:
            return e.status, {"error": {"message": e.message, "status": e.status}}

    def refusal(self, headers: Mapping[str, str]) -> _Refused | None:
        """Why a request with these headers is refused (403 / 401), or None."""
        try:
            self._authorize(headers)
        except _Refused as e:
            return e
        return None

    def _authorize(self, headers: Mapping[str, str]) -> None:
        if not self.token:
            raise _Refused(
                403, "the control plane is off: start the proxy with --set polar_control_token=..."
            )
        auth = headers.get("authorization") or ""
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise _Refused(401, "missing or wrong control token (Authorization: Bearer ...)")

    async def _route(
        self, method: str, parts: list[str], query: dict[str, list[str]], body: bytes
    ) -> dict[str, Any]:
        head = parts[0]
        state = self.state
        if parts == ["status"]:
            _method(method, "GET")
            return {**state.snapshot(), "rollouts_open": len(self.rollouts.open)}
        if parts == ["policy"]:
            if method == "GET":
                return {"policy_version": state.policy_version}
            _method(method, "POST", "PUT")
            version = _json(body).get("version")
            if version is not None and (not isinstance(version, str) or not version):
                raise _Refused(400, "'version' must be a non-empty string or null")
            previous, state.policy_version = state.policy_version, version
            log.info("polar-mitm: policy version %s -> %s", previous, version)
            return {"policy_version": version, "previous": previous}
        if parts == ["pause"]:
            _method(method, "POST")
            wait_s = _json(body).get("wait_s", 0)
            if (
                isinstance(wait_s, bool)
                or not isinstance(wait_s, int | float)
                or not (math.isfinite(wait_s) and 0 <= wait_s <= 3600)
            ):
                raise _Refused(400, "'wait_s' must be a number of seconds between 0 and 3600")
            state.pause()
            drained = await state.drained(wait_s) if wait_s else not state.in_flight
            return {**state.snapshot(), "drained": drained}
        if parts == ["resume"]:
            _method(method, "POST")
            released = state.resume()
            return {**state.snapshot(), "released": released}
        if parts == ["weights"]:
            if method == "GET":
                engine = await asyncio.to_thread(self.engine.describe) if self.engine else None
                return {
                    "weights": self.weights,
                    "policy_version": state.policy_version,
                    "engine": engine,
                }
            _method(method, "POST")
            return await self.push_weights(_json(body))
        if parts == ["groups"]:
            _method(method, "GET")
            return {"groups": self.rollouts.groups()}
        if head == "rollouts" and len(parts) == 1:
            _method(method, "GET")
            group = (query.get("group") or [None])[0]
            wanted = (query.get("state") or [None])[0]
            return {"rollouts": self.rollouts.listing(group, wanted)}
        if head == "rollouts" and len(parts) in (2, 3):
            rollout_id = parts[1]
            action = parts[2] if len(parts) == 3 else None
            if action is None:
                _method(method, "GET")
                rollout = self.rollouts.get(rollout_id)
                if rollout is None:
                    raise _Refused(404, f"no rollout {rollout_id!r} is open or recently ended")
                return rollout.summary(self.rollouts.allow, self.rollouts.strict)
            if action == "traces":
                _method(method, "GET")
                return self.rollouts.traces_json(rollout_id)
            if action == "end":
                _method(method, "POST")
                data = _json(body)
                if self.settle is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.settle(), SETTLE_S)
                if self.rollouts.get(rollout_id) is None:
                    state.ended_empty += 1
                    log.error("polar-mitm: " + ENDED_EMPTY.format(id=rollout_id))
                    raise _Refused(404, ENDED_EMPTY.format(id=rollout_id))
                rollout = self.rollouts.end(
                    rollout_id, reward=data.get("reward"), status=data.get("status", "completed")
                )
                return rollout.summary(self.rollouts.allow, self.rollouts.strict)
        raise _Refused(404, f"no control endpoint /v1/{'/'.join(parts)}")

    async def push_weights(self, data: dict[str, Any]) -> dict[str, Any]:
        """One weight push: check the checkpoint (a bad one is refused and nothing changes), new
        calls wait, calls in flight drain, the engine loads the folder, the policy version
        changes, waiting calls go on. Calls are stamped with the version when they start and
        when they end, so none is recorded under a version that did not sample it, and a rollout
        whose calls straddle the push is ``policy_mixed``. An engine that fails the reload is
        brought back on the last good weights (`Engine.recover`) and the version stays."""
        path, version, wait_s, engine = self._push_request(data)
        if self._push_lock.locked():
            raise _Refused(409, "a weight push is already under way")
        async with self._push_lock:
            state = self.state
            t0 = time.monotonic()
            try:
                checked = await asyncio.to_thread(check_checkpoint, path, self.weights)
            except WeightsRefused as e:
                raise _Refused(422, f"checkpoint refused, nothing changed: {e}") from None
            t_check = time.monotonic()
            was_paused, keep_paused = state.paused, False
            state.pause()
            try:
                if not await state.drained(wait_s):
                    raise _Refused(
                        409,
                        f"{len(state.in_flight)} calls still in flight after {wait_s} s: "
                        "nothing changed",
                    )
                t_drain = time.monotonic()
                try:
                    await self._reload(engine, path, version)
                except _StayPaused:
                    keep_paused = True  # until the engine is back: nothing goes to a dead one
                    raise
                previous, state.policy_version = state.policy_version, version
                log.info("polar-mitm: pushed %s, policy version %s -> %s", path, previous, version)
                self.weights = path
                t_end = time.monotonic()
                seconds = {
                    "check": t_check - t0,
                    "drain": t_drain - t_check,
                    "reload": t_end - t_drain,
                }
                return {
                    **state.snapshot(),
                    "paused": was_paused,
                    "previous": previous,
                    "weights": path,
                    "checked": checked,
                    "seconds": {k: round(v, 3) for k, v in seconds.items()},
                }
            finally:
                if not was_paused and not keep_paused:
                    state.resume()

    def _push_request(self, data: dict[str, Any]) -> tuple[str, str, float, Engine]:
        path, version = data.get("path"), data.get("version")
        wait_s = data.get("wait_s", 120)
        if not isinstance(path, str) or not path:
            raise _Refused(400, "'path' must be the checkpoint folder's absolute path")
        if not isinstance(version, str) or not version:
            raise _Refused(400, "'version' must be a non-empty string (the new policy version)")
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, int | float)
            or not (math.isfinite(wait_s) and 0 <= wait_s <= 3600)
        ):
            raise _Refused(400, "'wait_s' must be a number of seconds between 0 and 3600")
        if self.engine is None:
            raise _Refused(
                409,
                "no engine to push weights into: start the proxy with --set polar_engine=vllm-dev",
            )
        return path, version, wait_s, self.engine

    async def _reload(self, engine: Engine, path: str, version: str) -> None:
        """The engine loads `path`; when it fails, back on the last good weights (a 502 either
        way; `_StayPaused` when the engine could not be brought back)."""
        try:
            await asyncio.to_thread(engine.reload, path, version)
            return
        except EngineFailed as e:
            failure = e
        current = self.state.policy_version
        if self.weights is None:
            raise _StayPaused(
                502,
                f"the engine failed the reload ({failure}); no earlier weights are known "
                "(polar_engine_weights): calls stay paused",
            )
        try:
            how = await asyncio.to_thread(engine.recover, self.weights, current)
        except EngineFailed as e:
            raise _StayPaused(
                502,
                f"the engine failed the reload ({failure}) and could not be brought back on "
                f"{self.weights}: {e}; calls stay paused",
            ) from None
        raise _Refused(
            502,
            f"the engine failed the reload ({failure}); {how}; the policy version stays {current}",
        )


def _method(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise _Refused(405, f"use {' or '.join(allowed)} here, not {method}")


def _json(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise _Refused(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _Refused(400, "the body must be a JSON object")
    return data


def encode(status: int, obj: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The response bytes and headers for an API answer."""
    headers = {"content-type": "application/json", "cache-control": "no-store"}
    if status == 401:
        headers["www-authenticate"] = 'Bearer realm="polar-mitm control"'
    return json.dumps(obj, ensure_ascii=False).encode(), headers


class ControlServer:
    """The control API on a port of its own (`polar_control_listen`), and ``GET /metrics``
    (Prometheus, `metrics.py`) when ``metrics`` is given."""

    def __init__(self, api: ControlAPI, metrics: MetricsAddon | None = None) -> None:
        self.api = api
        self.metrics = metrics
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self, host: str, port: int) -> str:
        app = web.Application(client_max_size=_BODY_LIMIT)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self._runner = runner
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path == "/metrics" and self.metrics is not None:
            return self._metrics(request)
        status, obj = await self.api.handle(
            request.method, request.raw_path, request.headers, await request.read()
        )
        body, headers = encode(status, obj)
        return web.Response(status=status, body=body, headers=headers)

    def _metrics(self, request: web.Request) -> web.Response:
        """The Prometheus text format; the control token unless polar_metrics_public."""
        refused = None if self.metrics.public else self.api.refusal(request.headers)
        if refused is None and request.method not in ("GET", "HEAD"):
            refused = _Refused(405, f"use GET here, not {request.method}")
        if refused is not None:
            obj = {"error": {"message": refused.message, "status": refused.status}}
            body, headers = encode(refused.status, obj)
            return web.Response(status=refused.status, body=body, headers=headers)
        from .metrics import CONTENT_TYPE

        body = self.metrics.metrics.exposition()
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE})


def parse_listen(value: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[v6]:PORT``) -> (host, port); host defaults to 127.0.0.1."""
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value.strip()
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not PORT or HOST:PORT")
    return host, int(port)
