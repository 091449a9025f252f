"""Starting and stopping NeMo Gym's CLI (`gym env start`) so that nothing outlives it.

Gym's ``env start`` runs a local Ray cluster, a head server and one shell + ``python app.py`` per
server. Started in the background it does not always stop on its SIGINT, and Ray's workers sit
in process groups of their own, so stopping the group is not enough: `GymSession` starts Gym in a
session of its own, and `stop` sends SIGINT to its group, waits, then kills whatever is left in
the session. Used by the e2e test and by examples/demo/demo_nemo_gym.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def session_members(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes in session `sid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class GymSession:
    """One ``gym env start`` (or any Gym command) in a session of its own, output to `log`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], cwd: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        """Wait for Gym's "All N / N servers ready!"; RuntimeError with the log if it stops or
        does not get there in time."""
        deadline = time.monotonic() + timeout
        while "servers ready!" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gym env start did not come up:\n{self.text()[-6000:]}")
            time.sleep(1)

    def stop(self, grace: float = 60.0) -> list[int]:
        """Stop Gym and everything it started; the pids that had to be killed after `grace`."""
        sid = self.proc.pid
        try:
            os.killpg(sid, signal.SIGINT)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while session_members(sid) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.5)
        left = session_members(sid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left
