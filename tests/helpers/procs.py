"""Real processes for end-to-end tests: the reference policy server and mitmdump with the addon."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT

BIN = Path(sys.executable).parent
MITMDUMP = str(BIN / "mitmdump")


def need(ok: bool, why: str, setup: str = "scripts/test.sh installs it") -> None:
    """Skip a test whose optional tier is missing, saying why; under CI (``CI`` set) fail
    instead, so that tier always runs there."""
    if ok:
        return
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI must have it: {setup})")
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose combined output is kept (and shown when a test fails).

    A thread drains the output as it comes: mitmdump prints a line per flow, and a pipe nobody
    reads fills after a few hundred flows and blocks the proxy."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self._seen = b""
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        while data := self.popen.stdout.read1(1 << 16):
            with self._cond:
                self._seen += data
                if not self._log.closed:
                    self._log.write(data)
                    self._log.flush()
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Wait until `pattern` appears in the output; fail with the output so far if it does not."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                match = regex.search(self._seen.decode("utf-8", "replace"))
                if match:
                    return match
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise RuntimeError(
                        f"{self.args[:3]} did not print {pattern!r} "
                        f"(rc={self.popen.poll()}):\n{self._seen.decode('utf-8', 'replace')}"
                    )
                self._cond.wait(min(left, 0.5))

    def output(self) -> str:
        with self._cond:
            return self._seen.decode("utf-8", "replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(10)
        with self._cond:
            self._log.close()
        return self.popen.returncode


@dataclass
class PolicyServer:
    proc: Proc
    url: str

    def stop(self) -> None:
        self.proc.stop(signal.SIGTERM)


def start_policy_server(
    tmp: Path, scenario: Path | str | None = None, extra: Iterable[str] = (), name: str = "policy"
) -> PolicyServer:
    args = [sys.executable, "-m", "polar_reference", "--port", "0"]
    if scenario is not None:
        args += ["--scenario", str(scenario)]
    args += list(extra)
    proc = Proc(args, tmp / f"{name}.log")
    match = proc.wait_for(r"policy-server listening on (http://\S+)", timeout=120)
    return PolicyServer(proc, match.group(1))


@dataclass
class Mitm:
    proc: Proc
    port: int
    confdir: Path
    output: Path | str
    options: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def proxy(self, user: str | None = None, password: str = "pw") -> str:
        return f"http://{user}:{password}@{self.host}:{self.port}" if user else self.url

    def stop(self, sig: int = signal.SIGINT) -> int:
        return self.proc.stop(sig)


def start_mitm(
    tmp: Path,
    confdir: Path,
    upstream: str | None,
    name: str = "mitm",
    listen_host: str = "127.0.0.1",
    scripts_before: Iterable[Path] = (),
    ready: str | None = r"polar-mitm: capturing",
    **options: object,
) -> Mitm:
    """mitmdump with addons/polar.py; `scripts_before` are loaded ahead of it (their hooks see
    each flow first), `listen_host` is for a harness in a network namespace, `ready` the line
    to wait for (None: only that it listens, for a proxy meant to fail at start-up)."""
    port = free_port()
    raw = str(options.pop("polar_output", tmp / f"{name}-data"))
    output = raw if "://" in raw else Path(raw)  # a URI (s3://…) is not a path
    opts: dict[str, str] = {"confdir": str(confdir), "polar_output": str(output)}
    if upstream is not None:
        opts["polar_upstream"] = upstream
    opts.update({k: str(v) for k, v in options.items()})
    args = [MITMDUMP]
    for script in scripts_before:
        args += ["-s", str(script)]
    args += [
        "-s",
        str(ROOT / "addons" / "polar.py"),
        "--listen-host",
        listen_host,
        "--listen-port",
        str(port),
    ]
    for key, value in opts.items():
        args += ["--set", f"{key}={value}"]
    proc = Proc(args, tmp / f"{name}.log")
    proc.wait_for(r"proxy listening at", timeout=120)
    if ready is not None:
        proc.wait_for(ready, timeout=120)
    return Mitm(proc, port, confdir, output, opts, listen_host)
