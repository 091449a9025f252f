"""The fault suite's shared parts: the ledger behind its one summary line, the secrets it uses (and
greps for at the end), and the reference policy server it injects faults with."""

from __future__ import annotations

import dataclasses
import secrets as _secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.clients import grep_bytes
from tests.helpers.procs import Mitm, PolicyServer, start_mitm, start_policy_server

from .harness import Ledger

SCENARIO = Path(__file__).parent / "scenario.json"
_LEDGER = pytest.StashKey[Ledger]()


@pytest.fixture(scope="session")
def ledger(request: pytest.FixtureRequest) -> Ledger:
    ledger = Ledger()
    request.config.stash[_LEDGER] = ledger
    return ledger


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    ledger = config.stash.get(_LEDGER, None)
    if ledger is not None:
        terminalreporter.write_line(ledger.line())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its figures to the controller, which prints the one line."""
    ledger = session.config.stash.get(_LEDGER, None)
    if ledger is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["polar_ledger"] = dataclasses.asdict(ledger)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001 - the xdist controller's hook
    figures = getattr(node, "workeroutput", {}).get("polar_ledger")
    if figures is not None:
        ledger = node.config.stash.setdefault(_LEDGER, Ledger())
        ledger.merge(Ledger(**figures))


class SecretBook:
    """Every credential the suite hands to a harness; none may reach the disk."""

    def __init__(self) -> None:
        self.values: list[str] = []

    def new(self, kind: str) -> str:
        value = f"{kind}-{_secrets.token_hex(12)}"
        self.values.append(value)
        return value

    def add(self, value: str) -> str:
        self.values.append(value)
        return value


@pytest.fixture(scope="session")
def secret_book(tmp_path_factory: pytest.TempPathFactory, ledger: Ledger) -> Iterator[SecretBook]:
    """At the end of the session, after every proxy has stopped and flushed: grep everything
    under the session's temp dir (outputs, journals, Parquet decoded, proxy and server logs)."""
    book = SecretBook()
    yield book
    root = tmp_path_factory.getbasetemp()
    found = grep_bytes(root, book.values) if book.values else {}
    ledger.secrets_found = sum(len(paths) for paths in found.values())
    assert not found, f"secrets on disk: {found}"


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    """The reference server (vLLM wire) every fault test in a module arms its faults on."""
    server = start_policy_server(tmp_path_factory.mktemp("policy"), SCENARIO)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_mitm(
    tmp_path_factory: pytest.TempPathFactory, confdir: Path, fault_server: PolicyServer
) -> Iterator:
    """`shared_mitm(name, **options)`: one proxy per (name, options) for the whole module, so a
    table of faults runs through one proxy (each fault must leave it working for the next).
    Records are written one shard each (`polar_flush_rows=1`): read them with `live_records`."""
    started: dict[tuple, Mitm] = {}

    def get(name: str, **options: object) -> Mitm:
        key = (name, *sorted((k, str(v)) for k, v in options.items()))
        if key not in started:
            tmp = tmp_path_factory.mktemp(f"mitm-{name}")
            started[key] = start_mitm(tmp, confdir, fault_server.url, polar_flush_rows=1, **options)
        return started[key]

    yield get
    for mitm in started.values():
        assert mitm.stop() == 0, mitm.proc.output()[-4000:]


def arm(server: PolicyServer, key: str, fault: dict | str) -> None:
    """Arm `fault` for the next request whose first user message is `key`."""
    r = httpx.post(server.url + "/_polar/faults", json={"key": key, "fault": fault}, timeout=10)
    r.raise_for_status()


def server_stats(server: PolicyServer) -> dict[str, int]:
    return httpx.get(server.url + "/_polar/stats", timeout=10).json()


def reset_server(server: PolicyServer) -> None:
    httpx.post(server.url + "/_polar/reset", timeout=10).raise_for_status()
