"""The NeMo Gym resources server for coding tasks (``resources_servers/polar_coding``).

``/seed_session`` lays the task's repo out in the workspace the agent names; ``/verify`` runs the
task's test there and returns the reward (1.0: the test passes) with a reason when it is 0. The
workspace is the agent's: both servers run on one machine, as Gym's local ``env start`` runs them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import HTTPException
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import BaseModel, ConfigDict

from .coding_tasks import TASKS_DIR, TaskError, load_task, seed, verify


class CodingTasksConfig(BaseResourcesServerConfig):
    tasks_dir: str | None = None  # default: the task set shipped in polar_mitm/nemo_gym/tasks
    test_timeout_s: float = 60.0


class CodingSeedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    task_id: str
    workspace: str


class CodingSeedResponse(BaseSeedSessionResponse):
    workspace: str


class CodingVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    task_id: str
    workspace: str


class CodingVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    task_id: str
    test_passed: bool
    reason: str | None = None
    test_output: str = ""


class CodingTasksServer(SimpleResourcesServer):
    config: CodingTasksConfig

    @property
    def tasks_dir(self) -> Path:
        return Path(self.config.tasks_dir) if self.config.tasks_dir else TASKS_DIR

    async def seed_session(self, body: CodingSeedRequest) -> CodingSeedResponse:
        try:
            seed(load_task(body.task_id, self.tasks_dir), Path(body.workspace))
        except TaskError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        return CodingSeedResponse(workspace=body.workspace)

    async def verify(self, body: CodingVerifyRequest) -> CodingVerifyResponse:
        fields = body.model_dump()
        try:
            task = load_task(body.task_id, self.tasks_dir)
        except TaskError as e:
            return CodingVerifyResponse(**fields, reward=0.0, test_passed=False, reason=str(e))
        verdict = await asyncio.to_thread(
            verify, task, Path(body.workspace), self.config.test_timeout_s
        )
        return CodingVerifyResponse(
            **fields,
            reward=verdict.reward,
            test_passed=verdict.passed,
            reason=verdict.reason,
            test_output=verdict.output,
        )
