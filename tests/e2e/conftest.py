"""Fixtures of the real-harness tests: the pinned npm binaries and a network namespace each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harnesses import InstallError, install
from .netns import Netns, NetnsError, create_netns


@pytest.fixture(scope="session")
def harness_bin() -> Path:
    """node_modules/.bin of the pinned harnesses. A failed install fails the tests: never a skip."""
    try:
        return install()
    except InstallError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def netns(request: pytest.FixtureRequest) -> Iterator[Netns]:
    """A namespace whose only way out is a veth link to the host (where the proxy listens)."""
    try:
        ns = create_netns(request.node.name.rpartition("[")[2].rstrip("]")[:3] or "e2e")
    except NetnsError as e:
        pytest.fail(
            f"cannot create a network namespace ({e}): the harness tests run each harness in "
            "one so that bypassing the proxy fails; they need root with CAP_NET_ADMIN",
            pytrace=False,
        )
    yield ns
    ns.delete()


@pytest.fixture
def harness_session(harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm):
    """Run a harness (Codex unless named) through the proxy with these keywords
    (test_harnesses.run_through_proxy's; a 300 s time-out unless given); it must exit 0. Returns
    (result, what everyone saw, the policy server, a log for assertion messages)."""
    from .test_harnesses import run_through_proxy

    def run(name: str = "codex", **keywords):
        keywords.setdefault("timeout", 300)
        result, seen, server = run_through_proxy(
            name, harness_bin, netns, tmp_path, confdir, make_policy_server, make_mitm, **keywords
        )
        log = f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        assert result.returncode == 0, log
        return result, seen, server, log

    return run
