"""tests/helpers/shared_servers.py under real pytest-xdist (one run of two workers, for both
cases): two workers that both need the same server get one, started once, and it is stopped when
the run ends; one that fails to start fails every worker with its reason, tried once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)

CONFTEST = r"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.shared_servers import run_wide_server
from tests.helpers.waits import wait_until


def started(name):
    with open(os.environ["STARTS"], "a") as starts:
        starts.write(name + "\n")


def start(log: Path):
    started("web")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    port = wait_until(lambda: re.search(r"port (\d+)", log.read_text()), "the port")[1]
    return proc, {"url": f"http://127.0.0.1:{port}/", "pid": proc.pid}


def start_broken(log: Path):
    started("broken")
    raise RuntimeError("no model here")


@pytest.fixture(scope="session")
def server(request):
    return run_wide_server(request.config, "web", start)


@pytest.fixture(scope="session")
def broken(request):
    return run_wide_server(request.config, "broken", start_broken)
"""

TEST = r"""
import os
import urllib.request


def test_uses_the_server(server):
    with urllib.request.urlopen(server["url"], timeout=30) as r:
        assert r.status == 200
    with open(os.environ["SEEN"], "a") as seen:
        seen.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {server['pid']}\n")


def test_uses_the_broken_one(broken):
    pass
"""


def test_workers_share_one_server_started_once_and_stopped_at_the_end(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for n in ("a", "b"):  # two files: --dist loadfile gives one to each worker
        (tmp_path / f"test_{n}.py").write_text(TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"PYTHONPATH": str(ROOT), "STARTS": str(tmp_path / "starts")}
    env |= {"SEEN": str(tmp_path / "seen")}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.helpers.shared_servers",
    ]
    argv += ["-n", "2", "--dist", "loadfile", f"--basetemp={tmp_path / 'base'}"]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)

    assert r.returncode == 1, r.stdout + r.stderr  # the broken server's two errors
    assert "2 passed, 2 errors" in r.stdout, r.stdout
    assert sorted((tmp_path / "starts").read_text().split()) == ["broken", "web"]
    seen = (tmp_path / "seen").read_text().split("\n")[:-1]
    workers, pids = zip(*(line.split() for line in seen), strict=True)
    assert sorted(workers) == ["gw0", "gw1"] and len(set(pids)) == 1
    pid = int(pids[0])
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), "the server to stop")
    # the worker that tried has the start's own exception, the other its reason at once
    assert "RuntimeError: no model here" in r.stdout
    assert "run-wide server 'broken' could not start: RuntimeError: no model here" in r.stdout


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
