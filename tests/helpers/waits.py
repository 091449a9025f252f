"""Waiting in tests: poll for the condition a test needs (a file written, a counter reached, a
request seen), never sleep for a fixed time. The deadline is a failure guard sized for a slow,
busy machine (a CPU-bound model server beside the suite), not the time the condition should
take: a condition that holds returns at once, so a generous deadline costs nothing when all is
well, and speed is the benchmarks' business (polar_bench/), not a test's pass or fail."""

from __future__ import annotations

import time
from collections.abc import Callable

# Seconds to wait for what takes well under a second on a quiet machine.
SLOW_MACHINE = 60.0


def wait_until[T](
    predicate: Callable[[], T], what: str, timeout: float = SLOW_MACHINE, every: float = 0.05
) -> T:
    """Call `predicate` until it returns something truthy and return that; past `timeout`
    seconds, fail saying what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
