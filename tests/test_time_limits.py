"""tests/helpers/time_limits.py, tried for real: pytest runs, in a subprocess, a file of tests
that hang in each place a test can (its body, a fixture's set-up or teardown, a subprocess wait)
and one whose report takes longer than its limit to build (where pytest-timeout alone ends the run
in INTERNALERROR); each hung test must fail alone, named and with its stack, and the others pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)

HANG = 60  # seconds a hung test would block: far past every limit below

CONFTEST = """
import time
import pytest

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # A report that takes long to build (a long traceback formatted on a busy machine): with
    # pytest-timeout alone its alarm goes off here, in pytest's own code.
    if item.name == "test_slow_report" and call.when == "call":
        time.sleep(2)
    return (yield)
"""

TESTS = f"""
import signal
import subprocess
import time
from pathlib import Path

import pytest

@pytest.fixture(scope="module")
def shared():
    time.sleep(2)  # shared set-up: runs on its own clock, not on the first test's 1 s
    return "ready"

@pytest.fixture
def hung_setup():
    time.sleep({HANG})
    yield

@pytest.fixture
def hung_teardown():
    yield
    time.sleep({HANG})

@pytest.mark.timeout(1)
def test_shared_first(shared):
    assert shared == "ready"

@pytest.mark.timeout(0.5)
def test_body():
    time.sleep({HANG})

@pytest.mark.timeout(0.5)
def test_setup(hung_setup):
    pass

@pytest.mark.timeout(0.5)
def test_teardown(hung_teardown):
    pass

@pytest.mark.timeout(0.5)
def test_subprocess_run():
    subprocess.run(["sleep", "{HANG}"])

@pytest.mark.timeout(0.5)
def test_popen_wait():
    child = subprocess.Popen(["sleep", "{HANG + 1}"])
    Path("popen.pid").write_text(str(child.pid))
    child.wait()

@pytest.mark.timeout(1)
def test_slow_report():
    pass

@pytest.mark.timeout(0.5)
def test_deaf():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep({HANG})

def test_last():
    pass
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hung")
    (path / "pytest.ini").write_text("[pytest]\ntimeout = 30\n")
    (path / "conftest.py").write_text(CONFTEST)
    (path / "test_hung.py").write_text(textwrap.dedent(TESTS))
    return path


def run_pytest(project: Path, *args: str, plugin: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "POLAR_TEST_"))}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    argv += ["-p", "tests.helpers.time_limits"] if plugin else []
    return subprocess.run(
        [*argv, *args], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )


def outcomes(junit: Path) -> dict[str, str]:
    """Test name -> 'passed', or 'failed: <message>' / 'error: <message>'."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        verdict = "passed"
        for kind in ("failure", "error"):
            for node in case.iter(kind):
                verdict = f"{'failed' if kind == 'failure' else 'error'}: {node.get('message')}"
        out[case.get("name")] = verdict
    return out


def test_each_hung_test_fails_alone_with_its_stack_and_the_run_goes_on(project: Path) -> None:
    r = run_pytest(project, "-k", "not deaf", "--junitxml=report.xml")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "INTERNALERROR" not in r.stdout + r.stderr
    got = outcomes(project / "report.xml")
    for name in ("test_shared_first", "test_slow_report", "test_last"):
        assert got[name] == "passed", (name, got[name], r.stdout)
    phases = {
        "test_body": "failed: Failed: Timeout: test_hung.py::test_body ran past 0.5 s in its "
        "set-up and call (the limit from its mark timeout(0.5))",
        "test_setup": 'error: failed on setup with "Failed: Timeout: test_hung.py::test_setup '
        "ran past 0.5 s in its set-up",
        "test_teardown": 'error: failed on teardown with "Failed: Timeout: '
        "test_hung.py::test_teardown ran past 0.5 s in its teardown",
        "test_subprocess_run": "failed: Failed: Timeout: test_hung.py::test_subprocess_run ran "
        "past 0.5 s in its set-up and call",
        "test_popen_wait": "failed: Failed: Timeout: test_hung.py::test_popen_wait ran past 0.5 s "
        "in its set-up and call",
    }
    for name, reason in phases.items():
        assert got[name].startswith(reason), (name, got[name])
    # the stack of the main thread at the alarm is the failure's traceback
    assert f"time.sleep({HANG})" in r.stdout
    assert "in communicate" in r.stdout  # subprocess.run's wait
    # a hung subprocess is named in the reason; the one the test left behind is killed after it
    assert re.search(rf"child processes still running:\nE +\d+ sleep {HANG + 1}\n", r.stdout)
    pid = int((project / "popen.pid").read_text())
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        if state == "Z":  # killed; its parent (the inner pytest) is gone: being reaped
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or state == "Z", f"sleep {pid} still runs"


def test_the_slow_report_is_what_ends_a_run_under_pytest_timeout_alone(project: Path) -> None:
    """The control: without tests/helpers/time_limits.py, pytest-timeout's alarm lands in pytest's
    own report hook and the run ends in INTERNALERROR (exit 3), the next test never run."""
    r = run_pytest(project, "-k", "slow_report or last", plugin=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "INTERNALERROR" in r.stdout + r.stderr and "Timeout (>1.0s)" in r.stdout + r.stderr


def test_a_main_thread_deaf_to_the_alarm_is_stopped_with_its_stacks(project: Path) -> None:
    r = run_pytest(project, "-k", "deaf", "-o", "time_limit_hard_grace=1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "polar time limits: test_hung.py::test_deaf ran past 0.5 s in its set-up and call and "
        "did not answer the alarm for 1 s: stopping this process (exit 1)" in r.stderr
    )
    assert "stack of thread 'MainThread'" in r.stderr and "in test_deaf" in r.stderr
