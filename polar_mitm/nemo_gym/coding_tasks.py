"""The coding tasks the NeMo Gym resources server ships: each a tiny repo with a failing test.

A task is a folder ``tasks/<id>/`` with ``repo/`` (copied into the rollout's workspace before the
harness runs) and ``task.json``: the ``prompt`` the harness gets, the ``test`` command (argv;
``python`` means the resources server's own interpreter) and the ``test_files`` that are put back
from the task before the test runs, so a harness that edits the test instead of the code does not
earn the reward. The reward is 1.0 when the test exits 0 within the time-out, else 0.0, with a
reason. Standard library only: this runs inside NeMo Gym's venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


class TaskError(ValueError):
    """A task id that is not in the task set, or a malformed task folder."""


@dataclass(frozen=True)
class Task:
    task_id: str
    folder: Path
    prompt: str
    test: list[str]
    test_files: list[str]


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: bool
    reason: str | None  # why the reward is 0; None when the test passed
    output: str  # the test's last output lines


def load_task(task_id: str, tasks_dir: Path = TASKS_DIR) -> Task:
    folder = tasks_dir / task_id
    if (
        not task_id
        or "/" in task_id
        or task_id.startswith(".")
        or not (folder / "task.json").is_file()
    ):
        known = sorted(p.name for p in tasks_dir.iterdir() if (p / "task.json").is_file())
        raise TaskError(f"no task {task_id!r} in {tasks_dir} (tasks: {', '.join(known)})")
    try:
        spec: dict[str, Any] = json.loads((folder / "task.json").read_text())
        return Task(
            task_id, folder, spec["prompt"], list(spec["test"]), list(spec.get("test_files", []))
        )
    except (ValueError, KeyError, TypeError) as e:
        raise TaskError(f"{folder / 'task.json'} is malformed: {e}") from None


def task_rows(tasks_dir: Path = TASKS_DIR) -> list[dict[str, Any]]:
    """The task set as NeMo Gym input rows (``gym eval run --input``): one per task."""
    rows = []
    for folder in sorted(p for p in tasks_dir.iterdir() if (p / "task.json").is_file()):
        task = load_task(folder.name, tasks_dir)
        rows.append(
            {
                "task_id": task.task_id,
                "responses_create_params": {"input": [{"role": "user", "content": task.prompt}]},
            }
        )
    return rows


def seed(task: Task, workspace: Path) -> None:
    """A fresh copy of the task's repo at `workspace` (whatever was there is removed)."""
    if not workspace.is_absolute():
        raise TaskError(f"the workspace must be an absolute path, got {str(workspace)!r}")
    shutil.rmtree(workspace, ignore_errors=True)
    shutil.copytree(task.folder / "repo", workspace)


def verify(task: Task, workspace: Path, timeout: float) -> Verdict:
    """Put the task's test files back, run its test in `workspace`, and score it."""
    if not workspace.is_dir():
        return Verdict(0.0, False, f"the workspace {workspace} does not exist", "")
    for name in task.test_files:
        shutil.copy2(task.folder / "repo" / name, workspace / name)
    argv = [sys.executable if a == "python" else a for a in task.test]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(workspace),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    try:
        r = subprocess.run(
            argv,
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return Verdict(0.0, False, f"the test did not finish within {timeout:g} s", "")
    except OSError as e:
        return Verdict(0.0, False, f"the test could not start: {e}", "")
    output = "\n".join((r.stdout + r.stderr).strip().splitlines()[-20:])
    if r.returncode == 0:
        return Verdict(1.0, True, None, output)
    return Verdict(0.0, False, f"the test failed (exit {r.returncode})", output)
