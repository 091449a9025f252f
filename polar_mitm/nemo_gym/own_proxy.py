"""A polar-mitm proxy the NeMo Gym agent starts for itself (``start_proxy`` in its config).

For a run without a proxy of its own: the agent starts ``mitmdump -s addons/polar.py`` (from the
venv that has mitmproxy; Gym's has not) on a free loopback port, upstream the policy server
(NeMo RL's vLLM, say), with the control token from the agent's environment, and waits until it
captures. The proxy dies with the agent: it gets SIGTERM when the agent process exits
(``PR_SET_PDEATHSIG``), so a stopped Gym leaves no proxy behind. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ADDON = Path(__file__).resolve().parents[2] / "addons" / "polar.py"
_PR_SET_PDEATHSIG = 1


class ProxyStartError(RuntimeError):
    pass


@dataclass
class OwnProxy:
    proc: subprocess.Popen
    url: str
    ca_cert: Path
    log: Path


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent (the agent) exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(
    mitmdump: str, upstream: str, folder: Path, token: str, options: dict[str, str] | None = None
) -> OwnProxy:
    """Start mitmdump with the addon under `folder` (confdir ``certs/``, output ``polar-data/``,
    ``mitm.log``). Call it from the thread that lives as long as the agent (the event loop's):
    the death signal follows the thread that started the child, not the process."""
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = {
        "confdir": str(folder / "certs"),
        "polar_output": str(folder / "polar-data"),
        "polar_upstream": upstream,
        "polar_keep_ended": "256",
        **(options or {}),
    }
    args = [mitmdump, "-s", str(ADDON), "--listen-host", "127.0.0.1", "--listen-port", str(port)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    log = folder / "mitm.log"
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # the token through the environment the addon reads, never on the command line
                # where `ps` shows it (polar_control_token stays unset)
                env={**os.environ, "POLAR_CONTROL_TOKEN": token},
                preexec_fn=_die_with_parent,  # only prctl between fork and exec
            )
    except OSError as e:
        raise ProxyStartError(f"start_proxy: cannot run {mitmdump}: {e}") from None
    return OwnProxy(
        proc, f"http://127.0.0.1:{port}", folder / "certs" / "mitmproxy-ca-cert.pem", log
    )


def wait_ready(own: OwnProxy, timeout: float = 90.0) -> None:
    """Wait until the proxy captures; ProxyStartError (with its log) if it stops or is late."""
    deadline = time.monotonic() + timeout
    while "polar-mitm: capturing" not in own.log.read_text(errors="replace"):
        if own.proc.poll() is not None or time.monotonic() > deadline:
            own.proc.kill()
            tail = own.log.read_text(errors="replace")[-3000:]
            raise ProxyStartError(f"start_proxy: mitmdump did not start:\n{tail}")
        time.sleep(0.2)
