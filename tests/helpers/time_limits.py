"""Time limits that fail the test that runs past its time, never the run (a pytest plugin).

pytest-timeout's signal method arms SIGALRM around a test's whole run protocol, so on a busy
machine the alarm can go off in pytest's own code between the phases (building a report, writing
the terminal line, ...), where the `Failed` it raises is caught by nothing: INTERNALERROR, exit 3,
no test named, the rest of the run never run. Here pytest-timeout still reads the limits (the
`timeout` setting, `--timeout`, `@pytest.mark.timeout(seconds)`), but its
`pytest_timeout_set_timer` hook hands the timer to this plugin, which arms the alarm only inside a
phase's hook call (set-up, call, teardown): the part pytest's `CallInfo.from_call` turns into that
test's report. An alarm that arrives after its phase ended is ignored. So a test past its limit
fails alone, with a named reason, its stack (the traceback), the other threads' stacks and the
child processes still running; the run goes on.

- A test's limit covers its set-up and call; its teardown gets a limit of its own of the same size
  (a timed-out call must still stop its processes).
- Set-up shared by several tests (a fixture scoped wider than a function: a proxy per module, a
  harness install or a model server per session) runs on a clock of its own, not on the first
  test's: `time_limit_shared_setup` seconds, or what the fixture declares with
  `@shared_setup_limit(seconds)`. The teardown that ends such fixtures (a module's or the
  session's last test) gets that much too.
- After the teardown of a test that timed out, the child processes it started and left running
  are killed (a warning names them); those of shared fixtures are left to their own teardown.
- A main thread that does not answer the alarm (stuck in C code that retries on EINTR) is stopped
  `time_limit_hard_grace` seconds later by a watchdog thread, which writes the test's captured
  output and every thread's stack to stderr and exits the process (1). Under pytest-xdist the
  controller reports that test as crashed and a fresh worker runs the rest.
- `POLAR_TEST_TIME_SCALE=2` doubles every limit (for a machine known to be slower than CI's).

Per-directory defaults (`TIERS`) give a test without its own marker the limit its kind needs.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

# Defaults of the two ini settings (pyproject.toml [tool.pytest.ini_options] may set them).
SHARED_SETUP = 900.0  # time_limit_shared_setup: a harness install may take 15 minutes
HARD_GRACE = 120.0  # time_limit_hard_grace: after an alarm the main thread did not answer

# The limit of a test that sets none itself (@pytest.mark.timeout on it, its class or its module
# `pytestmark`), by where it lives, first match wins; the `timeout` setting in pyproject.toml (30 s)
# is everything else's: the unit tests, a second or less each. Each limit is some 5x what the
# slowest test it covers took in a full run at load 6-11 on 2 cores (README "Tests"); shared
# set-up (a module's proxy, the session's harness install) is not counted in it. Paths are
# fnmatch patterns, whose `*` also matches `/`: `tests/e2e/test_*` is the real-harness tests at the
# top of tests/e2e/, not those of tests/e2e/loopback/.
TIERS: tuple[tuple[str, float], ...] = (
    ("tests/e2e/test_*", 300.0),  # a real harness run (its own timeout is 180 s); loaded max 49 s
    ("tests/vllm/test_harnesses_vllm.py", 600.0),  # a real harness on the real vLLM (300 s own)
    ("tests/vllm/*", 420.0),  # the real vLLM's CPU engine; demo and bench start their own server
    ("tests/faults/test_fuzz.py", 600.0),  # 10,000 Hypothesis cases per table; loaded max 87 s
    ("tests/faults/*", 180.0),  # a proxy per module, faults injected; loaded max 29 s
    # tests/e2e/loopback/: our own processes on loopback; its test_vllm_script.py has the default
    ("tests/e2e/loopback/*_e2e.py", 180.0),  # a real mitmdump and policy server per test; max 68 s
    ("tests/e2e/loopback/test_bench_smoke.py", 600.0),  # the benchmarks, small; loaded max 127 s
    ("tests/e2e/loopback/test_realmodel.py", 300.0),  # llama.cpp; trainer checks: 900 s marks
    # Ray starts a local cluster; loaded max 28 s, but its job waited past 180 s at load 6 (2026-12-05)
    ("tests/e2e/loopback/test_readers.py", 420.0),
    ("tests/e2e/loopback/test_demo.py", 180.0),  # scripts/demo.sh end to end; loaded max 15 s
    ("tests/e2e/loopback/test_harness_fixtures.py", 120.0),  # recorded harness fixtures, a proxy
    ("tests/e2e/loopback/test_policy_server.py", 120.0),  # a policy server per test here and there
    ("tests/e2e/loopback/test_remote.py", 120.0),  # moto's S3 server, an outage
)

_SHARED_ATTR = "_polar_shared_setup_limit"
_SOURCE = pytest.StashKey[str]()
F = TypeVar("F", bound=Callable[..., Any])


def shared_setup_limit(seconds: float) -> Callable[[F], F]:
    """Give a fixture scoped wider than a function its own set-up limit (put it under
    @pytest.fixture): a server that takes minutes to load on a slow machine says so here."""

    def mark(func: F) -> F:
        setattr(func, _SHARED_ATTR, float(seconds))
        return func

    return mark


class TimeLimits:
    """The per-phase alarm (see the module's docstring); one per pytest process."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.scale = _scale()
        self.shared_setup = float(config.getini("time_limit_shared_setup")) * self.scale
        self.hard_grace = float(config.getini("time_limit_hard_grace"))
        self.settings: dict[str, Any] = {}  # nodeid -> pytest-timeout's Settings, while it runs
        self.item: pytest.Item | None = None
        self.deadline: float | None = None  # monotonic; None: nothing armed
        self.limit = 0.0
        self.what = ""  # what the armed clock is timing, for the failure's reason
        self.fired = False
        self.setup_clock: tuple[float, float] | None = None  # (deadline, limit) from set-up to call
        self.timed_out = False  # the running test ran past its limit in some phase
        self.spared: set[int] = set()  # child pids a timed-out test's clean-up leaves alone
        self.watchdog = _Watchdog(self._unanswered)
        self.previous = signal.signal(signal.SIGALRM, self._on_alarm)

    def close(self) -> None:
        self._disarm()
        signal.signal(signal.SIGALRM, self.previous)

    # pytest-timeout's hooks: it resolved the limit (marker, --timeout, ini) and asks for a timer.
    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
            return None  # pytest-timeout's own thread method
        self.settings[item.nodeid] = settings._replace(timeout=settings.timeout * self.scale)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        """Also called when a phase's failure is reported (for pdb): the settings stay until
        the test's end, so its teardown still has a limit."""
        if item.nodeid not in self.settings:
            return None
        if self.item is item:
            self._disarm()
        return True

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.settings.pop(nodeid, None)
        self.setup_clock, self.item = None, None

    # The three phases, innermost of the hook wrappers: the alarm is live only while these run.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        settings = self.settings.get(item.nodeid)
        if settings is None:
            return (yield)
        self.timed_out, self.spared = False, set(child_processes())
        if settings.func_only:
            return (yield)
        deadline = time.monotonic() + settings.timeout
        with self._armed(item, deadline, settings.timeout, "its set-up"):
            try:
                return (yield)
            finally:
                self.setup_clock = (self.deadline or deadline, settings.timeout)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        settings = self.settings.get(item.nodeid)
        if settings is None:
            return (yield)
        deadline, limit = self.setup_clock or (
            time.monotonic() + settings.timeout,
            settings.timeout,
        )
        with self._armed(item, deadline, limit, "its set-up and call"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator:
        settings = self.settings.get(item.nodeid)
        if settings is None:
            return (yield)
        limit, what = settings.timeout, "its teardown"
        if nextitem is None or nextitem.parent is not item.parent:
            limit, what = max(limit, self.shared_setup), "a teardown that ends shared fixtures"
        try:
            with self._armed(item, time.monotonic() + limit, limit, what):
                return (yield)
        finally:
            if self.timed_out:
                self._kill_leftovers(item)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: Any) -> Iterator:
        """A shared fixture's set-up runs on its own clock; the test's clock stops meanwhile."""
        if fixturedef.scope == "function" or self.deadline is None or self.fired:
            return (yield)
        saved = (self.deadline, self.limit, self.what)
        own = getattr(fixturedef.func, _SHARED_ATTR, None)
        limit = self.shared_setup if own is None else own * self.scale
        started = time.monotonic()
        what = f"the set-up of the {fixturedef.scope}-scoped fixture {fixturedef.argname!r}"
        self._arm(started + limit, limit, what)
        before = set(child_processes())
        try:
            return (yield)
        finally:
            self.spared |= set(child_processes()) - before  # the fixture's own, for later tests
            if not self.fired:
                self._arm(saved[0] + (time.monotonic() - started), saved[1], saved[2])

    @pytest.hookimpl
    def pytest_report_header(self) -> str:
        return (
            "time limits: tests/helpers/time_limits.py (per phase; shared set-up "
            f"{self.shared_setup:g} s; hard stop {self.hard_grace:g} s after an unanswered alarm; scale {self.scale:g})"
        )

    @contextmanager
    def _armed(self, item: pytest.Item, deadline: float, limit: float, what: str) -> Iterator:
        self.item, self.fired = item, False
        self._arm(deadline, limit, what)
        try:
            yield
        finally:
            self._disarm()

    def _arm(self, deadline: float, limit: float, what: str) -> None:
        self.deadline, self.limit, self.what = deadline, limit, what
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.001))
        self.watchdog.arm(deadline + self.hard_grace)

    def _disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.deadline = None
        self.watchdog.disarm()

    def _on_alarm(self, signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        if self.deadline is None or self.fired or self.item is None:
            return  # the phase ended just before: nothing of pytest's own is interrupted
        left = self.deadline - time.monotonic()
        if left > 0:  # early by the clocks' difference
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        from pytest_timeout import is_debugging

        if is_debugging():
            return
        self.fired = self.timed_out = True
        pytest.fail(self._reason(), pytrace=True)

    def _reason(self) -> str:
        assert self.item is not None
        source = self.item.stash.get(_SOURCE, "the `timeout` setting")
        lines = [
            f"Timeout: {self.item.nodeid} ran past {self.limit:g} s in {self.what} "
            f"(the limit from {source}); the main thread's stack is the traceback below"
        ]
        kids = child_processes()
        lines.append(
            "child processes still running:\n" + "\n".join(f"  {p} {a}" for p, a in kids.items())
            if kids
            else "no child process running"
        )
        lines.append(thread_stacks(skip={threading.get_ident(), self.watchdog.ident}))
        return "\n".join(lines)

    def _kill_leftovers(self, item: pytest.Item) -> None:
        """After a timed-out test's teardown: the processes it started and did not stop."""
        left = {p: a for p, a in child_processes().items() if p not in self.spared}
        if left:
            kill_all(left)
            item.warn(
                pytest.PytestWarning(
                    f"timed out, then left {len(left)} processes running; killed: "
                    + "; ".join(f"{p} {a}" for p, a in left.items())
                )
            )

    def _unanswered(self) -> None:
        """The alarm went unanswered for the hard grace: stop the process, stacks on stderr
        (not the terminal: an xdist worker's stdout is its channel, its stderr is the run's)."""
        item = self.item
        if item is None:
            return
        out = err = ""
        try:
            capman = self.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                capman.suspend_global_capture(item)
                out, err = capman.read_global_capture()
        finally:
            sys.stderr.write(
                f"\n+++ polar time limits: {item.nodeid} ran past {self.limit:g} s in "
                f"{self.what} and did not answer the alarm for {self.hard_grace:g} s: stopping "
                f"this process (exit 1)\n--- its captured stdout:\n{out[-4000:]}\n"
                f"--- its captured stderr:\n{err[-4000:]}\n"
                + thread_stacks(skip={threading.get_ident()})
                + "\n"
            )
            sys.stderr.flush()
            os._exit(1)


class _Watchdog:
    """One daemon thread that calls `expired` when an armed deadline passes unanswered."""

    def __init__(self, expired: Callable[[], None]) -> None:
        self.expired = expired
        self.cond = threading.Condition()
        self.deadline: float | None = None
        self.thread = threading.Thread(target=self._run, name="polar time limits", daemon=True)
        self.thread.start()
        self.ident = self.thread.ident

    def arm(self, deadline: float) -> None:
        with self.cond:
            self.deadline = deadline
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.deadline = None
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is None or left > 0:
                    self.cond.wait(left)
                    continue
                self.deadline = None
            self.expired()


def child_processes(pid: int | str = "self") -> dict[int, str]:
    """The live descendants of a process, pid -> argv, from /proc (empty elsewhere)."""
    out: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for kid in kids:
            try:
                argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            out[kid] = " ".join(a.decode(errors="replace") for a in argv if a)[:300]
            out.update(child_processes(kid))
    return out


def kill_all(pids: dict[int, str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone already


def thread_stacks(skip: set[int | None]) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [
        f"stack of thread {names.get(ident, '?')!r}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
        if ident not in skip
    ]
    return "\n".join(parts) if parts else "no other thread"


def _scale() -> float:
    raw = os.environ.get("POLAR_TEST_TIME_SCALE", "") or "1"
    try:
        scale = float(raw)
    except ValueError:
        raise pytest.UsageError(f"POLAR_TEST_TIME_SCALE={raw!r}: not a number") from None
    if scale <= 0:
        raise pytest.UsageError(f"POLAR_TEST_TIME_SCALE={raw!r}: must be above 0")
    return scale


_KEY = pytest.StashKey[TimeLimits]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "time_limit_shared_setup",
        "seconds the set-up of a fixture scoped wider than a function may take"
        " (tests/helpers/time_limits.py)",
        default=str(SHARED_SETUP),
    )
    parser.addini(
        "time_limit_hard_grace",
        "seconds after an unanswered timeout alarm before the process is stopped with its stacks",
        default=str(HARD_GRACE),
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        return  # -p no:timeout: no limits at all
    if threading.current_thread() is not threading.main_thread():
        return
    plugin = TimeLimits(config)
    config.stash[_KEY] = plugin
    config.pluginmanager.register(plugin, "polar-time-limits")


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.stash.get(_KEY, None)
    if plugin is not None:
        plugin.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test with no limit of its own gets its directory's (TIERS); each says where it came from."""
    for item in items:
        if (marker := item.get_closest_marker("timeout")) is not None:
            item.stash[_SOURCE] = f"its mark timeout({marker.args[0] if marker.args else ''})"
            continue
        try:
            path = item.path.relative_to(config.rootpath).as_posix()
        except ValueError:
            continue
        for pattern, seconds in TIERS:
            if fnmatch.fnmatch(path, pattern):
                item.add_marker(pytest.mark.timeout(seconds))
                item.stash[_SOURCE] = f"tests/helpers/time_limits.py TIERS {pattern!r}"
                break
