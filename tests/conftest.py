"""Shared fixtures: a CA made once per session, and factories for the real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_mitm.certs import ensure_ca
from tests.helpers.procs import Mitm, PolicyServer, start_mitm, start_policy_server

# fixtures: an S3 server on loopback, the AWS environment for it
from tests.helpers.s3 import moto_s3, s3_env  # noqa: F401

# Per-test time limits that fail the test, never the run; servers shared by all xdist workers.
pytest_plugins = [
    "tests.helpers.time_limits",
    "tests.helpers.shared_servers",
    "tests.helpers.xdist_groups",
]


@pytest.fixture(scope="session")
def confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("certs")
    ensure_ca(path)
    return path


# The policy-server wire kinds every dialect test runs against; tests/helpers/upstreams.py has each
# kind's truth (ids straight from the server, expected prompt ids).
UPSTREAM_KINDS = ["vllm", "sglang"]


@pytest.fixture(params=UPSTREAM_KINDS)
def upstream_kind(request: pytest.FixtureRequest) -> str:
    """Parametrize a test over the server kinds: use it with make_policy_server(kind=...) and
    make_mitm(..., polar_upstream_kind=...)."""
    return request.param


@pytest.fixture
def make_policy_server(tmp_path: Path) -> Iterator:
    started: list[PolicyServer] = []

    def make(scenario: Path | str | None = None, *extra: str, kind: str = "vllm") -> PolicyServer:
        args = [*extra, "--kind", kind] if kind != "vllm" else list(extra)
        server = start_policy_server(tmp_path, scenario, args, name=f"policy{len(started)}")
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def make_mitm(tmp_path: Path, confdir: Path) -> Iterator:
    started: list[Mitm] = []

    def make(upstream: str | None, **options: object) -> Mitm:
        mitm = start_mitm(tmp_path, confdir, upstream, name=f"mitm{len(started)}", **options)
        started.append(mitm)
        return mitm

    yield make
    for mitm in started:
        mitm.stop()
