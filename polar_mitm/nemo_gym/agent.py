"""The NeMo Gym agent (``responses_api_agents/polar_mitm_agent``): an unmodified harness, run
through polar-mitm, returned as a rollout NeMo RL can train on.

Per ``POST /run`` (one row of ``gym eval run``, one sample of a task):

1. the rollout id is ``<group>.<sample>``: the group is the row's task id (with the configured
   ``group_prefix``), the sample Gym's ``_ng_rollout_index``, so a task's repeats are one GRPO
   group on the proxy;
2. a fresh workspace and HOME; the resources server's ``/seed_session`` lays the task out in the
   workspace. With ``same_path_per_task`` every sample of a task runs at the same path (Pi writes
   the path into its prompt: samples in different folders get different prompts), one at a time;
3. the harness runs with the environment `polar-mitm env` prints for that rollout id;
4. ``/verify`` scores the workspace (skipped when the harness failed: reward 0 with the reason);
5. the rollout is ended through the proxy's control plane with that reward, and its final main
   trace comes back as Gym output items: each call's whole prompt ids, sampled ids and log probs
   (`items.output_items`), plus the trace's trainability in the ``polar`` field.

A harness that finished with zero captured calls (it never went through the proxy) is not
scored: its rollout fails with the likely cause named (captured.py), logged as an error.
Every failure (harness missing, non-zero exit, time-out, proxy unreachable, no trace) gives a
rollout with reward 0 and a ``polar.reason``, never a failed ``/run``: one bad sample must not
end a Gym collection. The control token is read from an environment variable, never from the
config: Gym puts the merged config in every server's environment and on its head server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException, Request
from nemo_gym.base_resources_server import BaseRunRequest, BaseVerifyResponse
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config_types import ResourcesServerRef
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server_utils import get_response_json
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..control import ControlClient, ControlError
from ..trajectory.traceview import main_trace
from .captured import captured_calls, empty_rollout_error
from .harness import DEFAULT_BIN_DIR, DEFAULT_MODEL, HARNESSES, harness_env, run_harness
from .items import STATUS, output_items, response
from .own_proxy import OwnProxy, ProxyStartError, launch, wait_ready

log = logging.getLogger(__name__)


class StartProxyConfig(BaseModel):
    """A proxy the agent starts for itself (own_proxy.py): for a run without one."""

    mitmdump: str  # the mitmdump of a venv with polar-mitm (Gym's venv has no mitmproxy)
    upstream: str  # the policy server, e.g. NeMo RL's vLLM: http://HOST:8000
    folder: str = "/tmp/polar-gym-proxy"  # its confdir (CA), polar_output and log
    options: dict[str, str] = Field(default_factory=dict)  # more --set name=value


class PolarMitmAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    harness: Literal[
        "pi",
        "claude",
        "codex",
        "qwen",
        "opencode",
        "gemini",
        "mini-swe-agent",
        "openhands",
        "hermes",
        "cline",
        "kilo",
        "aider",
        "openclaw",
    ] = "pi"
    harness_bin_dir: str | None = None  # default: where scripts/install_harnesses.sh puts them
    model: str = DEFAULT_MODEL  # the name the harness asks for (the proxy sends the policy's)
    proxy: str | None = None  # the polar-mitm proxy as the harness reaches it: http://HOST:PORT
    ca_cert: str | None = None  # the CA the harness trusts (`polar-mitm certs` prints its path)
    start_proxy: StartProxyConfig | None = None  # instead of proxy + ca_cert
    control_url: str | None = None  # polar_control_listen's URL; default: through the proxy
    control_token_env: str = "POLAR_CONTROL_TOKEN"  # the variable holding the control token
    group_prefix: str = ""  # e.g. a run id, so two collections do not reuse rollout ids
    workspace_root: str = "/tmp/polar-gym"
    same_path_per_task: bool = True
    keep_workspaces: bool = False
    timeout_s: float = 600.0
    concurrency: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _one_proxy(self) -> PolarMitmAgentConfig:
        if (self.proxy is None) == (self.start_proxy is None):
            raise ValueError("give either proxy (+ ca_cert) or start_proxy, not both or neither")
        if self.proxy is not None and self.ca_cert is None:
            raise ValueError("proxy needs ca_cert: the CA file the harness must trust")
        return self


class PolarRunRequest(BaseRunRequest):
    model_config = ConfigDict(extra="allow")
    task_id: str | None = None


class PolarVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    polar: dict[str, Any]


def prompt_text(params: NeMoGymResponseCreateParamsNonStreaming) -> str:
    """The last user message of the row's input: what the harness is asked."""
    if isinstance(params.input, str):
        return params.input
    for item in reversed(params.input):
        if getattr(item, "role", None) == "user":
            content = item.content
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") if isinstance(p, dict) else "" for p in content)
    return ""


class PolarMitmAgent(SimpleResponsesAPIAgent):
    """Runs `config.harness` through polar-mitm for each ``/run``."""

    config: PolarMitmAgentConfig
    model_config = ConfigDict(arbitrary_types_allowed=True)
    sem: asyncio.Semaphore | None = None
    locks: dict[str, asyncio.Lock] = Field(default_factory=dict)
    own: OwnProxy | None = None
    own_lock: asyncio.Lock | None = None

    def model_post_init(self, context: Any) -> None:
        self.sem = asyncio.Semaphore(self.config.concurrency)
        self.own_lock = asyncio.Lock()

    def token(self) -> str:
        return os.environ.get(self.config.control_token_env, "")

    async def endpoint(self) -> tuple[str, Path]:
        """The proxy's URL and CA: the configured ones, or the agent's own proxy (started on
        the first /run, in the process that serves; ProxyStartError if it does not start)."""
        start = self.config.start_proxy
        if start is None:
            return str(self.config.proxy), Path(str(self.config.ca_cert))
        assert self.own_lock is not None
        async with self.own_lock:
            if self.own is None or self.own.proc.poll() is not None:
                own = launch(
                    start.mitmdump, start.upstream, Path(start.folder), self.token(), start.options
                )
                await asyncio.to_thread(wait_ready, own)
                self.own = own
            return self.own.url, self.own.ca_cert

    def control(self) -> ControlClient:
        if self.config.control_url:
            return ControlClient(self.token(), url=self.config.control_url)
        return ControlClient(
            self.token(), proxy=self.own.url if self.own else str(self.config.proxy)
        )

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming) -> NeMoGymResponse:
        """Not served: a harness run needs a task (workspace) and ends with a reward."""
        raise HTTPException(
            501, "polar_mitm_agent serves POST /run (a task row), not /v1/responses"
        )

    async def run(self, request: Request, body: PolarRunRequest) -> PolarVerifyResponse:
        extra = body.model_extra or {}
        group = f"{self.config.group_prefix}{body.task_id or 'task' + str(extra.get('_ng_task_index', 0))}"
        rollout_id = f"{group}.{int(extra.get('_ng_rollout_index') or 0)}"
        lock = (
            self.locks.setdefault(group, asyncio.Lock()) if self.config.same_path_per_task else None
        )
        assert self.sem is not None
        async with self.sem:
            if lock is None:
                return await self._rollout(request, body, group, rollout_id)
            async with lock:
                return await self._rollout(request, body, group, rollout_id)

    async def _rollout(
        self, request: Request, body: PolarRunRequest, group: str, rollout_id: str
    ) -> PolarVerifyResponse:
        base = Path(self.config.workspace_root) / group
        if not self.config.same_path_per_task:
            base = base / rollout_id.rpartition(".")[2]
        work, home = base / "work", base / "home"
        shutil.rmtree(base, ignore_errors=True)
        home.mkdir(parents=True)
        fields = body.model_dump()
        cookies = request.cookies
        harness = HARNESSES[self.config.harness]
        info: dict[str, Any] = {
            "rollout_id": rollout_id,
            "group_id": group,
            "harness": harness.name,
        }
        try:
            seeded = await self.server_client.post(
                server_name=self.config.resources_server.name,
                url_path="/seed_session",
                json={**fields, "workspace": str(work)},
                cookies=cookies,
            )
            if not seeded.ok:
                text = (await seeded.read()).decode("utf-8", "replace")[:300]
                return self._failed(fields, info, f"/seed_session answered {seeded.status}: {text}")
            cookies = seeded.cookies
            try:
                proxy, ca_cert = await self.endpoint()
            except ProxyStartError as e:
                return self._failed(fields, info, str(e).splitlines()[0])
            bin_dir = Path(self.config.harness_bin_dir or DEFAULT_BIN_DIR)
            env = harness_env(harness, home, proxy, ca_cert, rollout_id, bin_dir)
            ran = await run_harness(
                harness,
                bin_dir,
                self.config.model,
                prompt_text(body.responses_create_params),
                work,
                env,
                self.config.timeout_s,
            )
            info.update(harness_returncode=ran.returncode, harness_seconds=round(ran.seconds, 3))
            reason = ran.error
            verdict: dict[str, Any] = {}
            if await asyncio.to_thread(captured_calls, self.control(), rollout_id) == 0:
                # It never went through the proxy: failed loudly, never scored (captured.py).
                info["captured_calls"] = 0
                reason = empty_rollout_error(harness.name, rollout_id, env)
                reason += f" ({ran.error})" if ran.error else ""
                log.error("polar_mitm_agent: %s", reason)
            elif reason is None:
                # Score what the harness left: the response Gym's verify type wants is the
                # trace as it is now (the final one, with the reward, comes after the end).
                snapshot = await self._trace(rollout_id, info)
                verified = await self.server_client.post(
                    server_name=self.config.resources_server.name,
                    url_path="/verify",
                    json={
                        **fields,
                        "workspace": str(work),
                        "response": self._response(snapshot, info),
                    },
                    cookies=cookies,
                )
                if verified.ok:
                    verdict = await get_response_json(verified)
                    reason = verdict.get("reason")
                else:
                    reason = f"/verify answered {verified.status}"
            reward = float(verdict.get("reward") or 0.0)
            status = (
                "completed"
                if ran.error is None
                else ("incomplete" if ran.returncode is None else "error")
            )
            trace = await self._end(rollout_id, reward, status, info)
            if trace is None and reason is None:
                reward, reason = 0.0, info["control_error"]
            info.update(reward=reward, reason=reason)
            out = {k: v for k, v in verdict.items() if k not in ("response", "reward")}
            return PolarVerifyResponse(
                **{**fields, **out},
                response=self._response(trace, info),
                reward=reward,
                polar=info,
            )
        finally:
            if not self.config.keep_workspaces:
                shutil.rmtree(base, ignore_errors=True)

    def _failed(
        self, fields: dict[str, Any], info: dict[str, Any], reason: str
    ) -> PolarVerifyResponse:
        info.update(reward=0.0, reason=reason)
        return PolarVerifyResponse(
            **fields, response=self._response(None, info), reward=0.0, polar=info
        )

    async def _trace(self, rollout_id: str, info: dict[str, Any]) -> dict[str, Any] | None:
        """The rollout's main trace from the control plane (None, noted in `info`, if none)."""
        try:
            traces = (await asyncio.to_thread(self.control().traces, rollout_id))["traces"]
        except ControlError as e:
            info["control_error"] = f"proxy control plane: {e}"
            return None
        if not traces:
            info["control_error"] = f"the proxy has no trace of rollout {rollout_id}"
            return None
        return main_trace(traces)

    async def _end(
        self, rollout_id: str, reward: float, status: str, info: dict[str, Any]
    ) -> dict[str, Any] | None:
        """End the rollout with its reward; its final main trace (None if it has none)."""
        try:
            ended = await asyncio.to_thread(self.control().end, rollout_id, reward, status)
        except ControlError as e:
            info["control_error"] = f"proxy control plane: {e}"
            return None
        info["ended"] = {k: ended.get(k) for k in ("status", "reward", "revision", "calls")}
        trace = await self._trace(rollout_id, info)
        if trace is not None:
            info.update(
                trace_id=trace["trace_id"],
                trainable=bool(trace.get("trainable")),
                untrainable_reason=trace.get("untrainable_reason"),
                trace_status=trace.get("status"),
                break_reason=trace.get("break_reason"),
                call_ids=list(trace.get("call_ids") or []),
            )
        return trace

    def _response(self, trace: dict[str, Any] | None, info: dict[str, Any]) -> dict[str, Any]:
        meta = {k: str(info[k]) for k in ("rollout_id", "group_id", "harness") if k in info}
        if trace is None:
            return response(f"polar-{info['rollout_id']}", self.config.model, [], "failed", meta)
        meta["trace_id"] = trace["trace_id"]
        meta["trainable"] = str(bool(trace.get("trainable"))).lower()
        return response(
            trace["trace_id"],
            self.config.model,
            output_items(trace),
            STATUS.get(trace.get("status") or "", "incomplete"),
            meta,
        )
