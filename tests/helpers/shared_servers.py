"""One expensive server for the whole test run, shared by every pytest-xdist worker (a plugin).

A session-scoped fixture is set up once per *process*: under `pytest -n 2` each worker would start
its own real vLLM (minutes of CPU each) and stop it when that worker's tests end, while the other
worker may still need one. `run_wide_server` starts the server once per run instead:

- the first process that needs `name` starts it, under an exclusive lock on a file in the run's
  shared temp dir (the controller's basetemp, the parent of each worker's); the others block on
  the lock until it is ready (a fixture's set-up has its own clock: tests/helpers/time_limits.py),
  then read what it wrote (a URL, ports, ...);
- a server that failed to start is recorded as such: the other workers fail at once with the
  same reason instead of spending minutes trying again;
- the server runs in a session of its own, its output to a file (never a pipe: the process that
  started it may finish first), and nobody stops it when a worker ends: the run's controller (or
  the single pytest process) stops every one of them, their whole process group, at the very end
  (`pytest_unconfigure`), crashed workers included.

Use it from a session fixture (see README "Tests" for the whole recipe):

    @pytest.fixture(scope="session")
    @shared_setup_limit(1800)  # tests/helpers/time_limits.py: a cold start on a busy machine
    def real_vllm(request) -> dict:
        return run_wide_server(request.config, "real-vllm", start_real_vllm)

where `start_real_vllm(log: Path) -> tuple[subprocess.Popen, dict]` starts the process with
`start_new_session=True` and its output to `log`, waits until it serves (raising if it does
not), and returns it with a JSON-able description (at least what tests need to reach it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_DIR = "run-wide-servers"
STOP_GRACE = 30.0  # seconds between SIGTERM and SIGKILL at the end of the run


def shared_dir(config: pytest.Config) -> Path:
    """The temp dir every process of this run sees: the controller's basetemp under xdist."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    root = base.parent if hasattr(config, "workerinput") else base
    path = root / _DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks; a SIGALRM (the time limit) interrupts it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_wide_server(
    config: pytest.Config,
    name: str,
    start: Callable[[Path], tuple[subprocess.Popen, dict[str, Any]]],
) -> dict[str, Any]:
    """The description `start` returned for the server `name`, started once for the whole run."""
    where = shared_dir(config)
    state = where / f"{name}.json"
    with _locked(where / f"{name}.lock"):
        if state.exists():
            known = json.loads(state.read_text())
            if "error" in known:
                pytest.fail(f"run-wide server {name!r} could not start: {known['error']}")
            if _alive(known["pid"]):
                return known["info"]
        try:
            proc, info = start(where / f"{name}.log")
        except Exception as e:
            state.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        state.write_text(json.dumps({"pid": proc.pid, "info": info}))
        return info


def stop_run_wide_servers(where: Path) -> list[str]:
    """Stop each server this run started (its process group): what was still running."""
    stopped = []
    for state in sorted(where.glob("*.json")):
        known = json.loads(state.read_text())
        pid = known.get("pid")
        if pid is None or not _alive(pid):
            continue
        stopped.append(state.stem)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        state.unlink()
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie (exited, not reaped by its parent) is not alive
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # a worker: the controller stops them once every worker is done
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or factory._basetemp is None:  # type: ignore[attr-defined]
        return  # no temp dir was ever made: no server either
    where = factory.getbasetemp() / _DIR
    if where.is_dir():
        stop_run_wide_servers(where)
