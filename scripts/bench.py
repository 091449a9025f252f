"""What polar-mitm costs a rollout farm, side by side with the alternatives, in one run.

Columns (same client, same upstream, same run):
  direct            client -> reference policy server over loopback HTTP (the physical limit)
  mitm-stream       plain mitmdump with scripts/bench_floor.py: api.openai.com -> server, reply
                    streamed (`flow.response.stream = True`): the floor for any addon that streams
  capture-floor     mitm-stream plus the least any token-capturing addon must do: ask the server for
                    token ids and logprobs and decode every streamed event to read them, with
                    msgspec, polar-mitm's own decoder (the chunks pass on unchanged): what capture
                    itself costs, whoever implements it
  mitm-buffered     the same, mitmdump's default buffering (the whole generation, then replayed)
  polar-mitm        mitmdump -s addons/polar.py (capture + journal + Parquet shards on)
  litellm           LiteLLM's proxy (a gateway at a base URL, chat path) in front of the same
                    server, when .venv-litellm holds it (`--litellm` installs it from PyPI)
  polar-mitm/responses, polar-mitm/messages
                    the same proxy, with Codex's (OpenAI Responses) and Claude Code's (Anthropic
                    Messages) streams: translated to chat completions upstream and back; latency
                    only, against polar-mitm's own chat column (nothing else speaks them here)
  polar-mitm/sglang, polar-mitm/sglang-nostream
                    polar-mitm in front of the reference server as SGLang 0.5.23 (streamed for
                    real with sglext ids once probed) and as an SGLang without sglext
                    (`--no-sglext`: called non-streaming, the harness's stream synthesized from
                    the whole reply); latency only, against polar-mitm's vLLM chat column

The proxy columns use the harness path: HTTPS to api.openai.com through HTTP CONNECT with the
generated CA. Figures: time to first byte, time to last byte, latency added over direct (median and
p99) at 1 and 32 concurrent sessions (upstream paced at --token-rate tokens/s, one chunk per
token), calls/s at 32 concurrent and proxy CPU-seconds per 1,000 calls (upstream as fast as it
goes; CPU from /proc), proxy RSS over a long run, and the in-process figures of the other
benchmarks (trajectory merge N vs 2N, Parquet flush vs raw pyarrow) where present.

Absolute times on shared machines are noise; the ratios in one run are the result.

    python scripts/bench.py --quick            # a few minutes on 2 cores
    python scripts/bench.py --quick --smoke    # tiny counts: only checks that it runs
    python scripts/bench.py --json out.json    # and out.png beside it
    python scripts/bench.py --quick --markdown # and the README's Markdown table
    python scripts/bench.py --quick --variant nohold:polar_durable_replies=false
                                               # one more polar-mitm column, other settings
    python scripts/bench.py --long [--quick]   # long agent sessions instead (bench_long.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
URL = "https://api.openai.com/v1/chat/completions"
COLUMNS = ("direct", "mitm-stream", "mitm-buffered", "polar-mitm", "capture-floor")
# The other harness dialects, through the same polar-mitm proxy (latency only: the floors and the
# server speak chat completions alone, so their yardstick is polar-mitm's own chat column).
DIALECT_COLUMNS = ("polar-mitm/responses", "polar-mitm/messages")
# polar-mitm with an SGLang upstream: each its own paced reference server (these server flags).
SGLANG_COLUMNS: dict[str, tuple[str, ...]] = {
    "polar-mitm/sglang": ("--kind", "sglang"),
    "polar-mitm/sglang-nostream": ("--kind", "sglang", "--no-sglext"),
}
# The polar-mitm column's own settings: rollouts end 1 s after their last call, as a farm's end
# when their reward is posted, so the proxy writes their traces during the run and keeps no
# trajectories of finished rollouts (the other benchmarks' proxies keep their rollouts open).
POLAR_OPTIONS = {"polar_rollout_idle": "1"}
SETTLE_S = 1.5  # after the last throughput slice: rollouts idle for 1 s end and are written
# --variant NAME:KEY=VALUE,...: more polar-mitm columns with other settings (what one costs).
VARIANTS: dict[str, dict[str, str]] = {}


def progress(message: str) -> None:
    """One line on stderr, with the seconds since the start (the run takes minutes)."""
    print(f"  [{time.monotonic() - STARTED:4.0f}s] {message}", file=sys.stderr, flush=True)


STARTED = time.monotonic()


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
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

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


LITELLM_VERSION = "1.108.7"
LITELLM_VENV = ROOT / ".venv-litellm"
LITELLM_KEY = "sk-bench-litellm-0123456789abcdef"  # a loopback-only master key for the column


def litellm_bin(install: bool) -> Path | None:
    """The LiteLLM proxy of the `litellm` column (its own venv: its pins are not ours); with
    `install`, set it up from PyPI (about 2 minutes) when missing."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists() and install:
        progress(f"installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        pip = subprocess.run(
            [
                str(LITELLM_VENV / "bin" / "pip"),
                "install",
                "-q",
                f"litellm[proxy]=={LITELLM_VERSION}",
            ],
            capture_output=True,
            text=True,
        )
        if pip.returncode != 0:  # pip's own words, without the index warnings before them
            sys.exit(f"bench.py: installing LiteLLM failed:\n{pip.stderr[-3000:]}")
    return exe if exe.exists() else None


def start_litellm(tmp: Path, upstream: str, name: str, wait: bool = True) -> tuple[Child, int]:
    """LiteLLM's proxy in front of the reference server: a gateway the harness would point its
    base URL at (chat completions, streaming passed through), offline and on loopback."""
    exe = litellm_bin(install=False)
    assert exe is not None
    port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: Qwen/Qwen3-4B\n"
        "    litellm_params:\n"
        "      model: openai/Qwen/Qwen3-4B\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    args = [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    env = {"LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    log = tmp / f"{name}.log"
    return Child(args, log, r"Application startup complete", 180, env, wait), port


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
        "polar_mitm.policy_server",
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
        args += ["-s", str(ROOT / "scripts" / "bench_floor.py")]
        ready = r"proxy listening"
    env = {
        "BENCH_UPSTREAM": upstream,
        "BENCH_STREAM": "1" if column.startswith(("mitm-stream", "capture-floor")) else "0",
        "BENCH_CAPTURE": "1" if column.startswith("capture-floor") else "0",
        "BENCH_GATEWAY": "1" if column.startswith("mitm-gateway") else "0",
    }
    return Child(args, tmp / f"{name or column}.log", ready, env=env, wait=wait), port


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


BODY = {
    "model": "Qwen/Qwen3-4B",  # the served name, so plain mitmdump and direct calls work too
    "stream": True,
    "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Write the benchmark reply."},
    ],
}


# Codex's and Claude Code's APIs: the same scripted reply, each stream's own last event.
DIALECT_CALLS = {
    "polar-mitm/responses": (
        "https://api.openai.com/v1/responses",
        {
            "model": "gpt-5",
            "instructions": "You are a coding agent.",
            "input": [{"role": "user", "content": "Write the benchmark reply."}],
            "stream": True,
            "store": False,
        },
        b"response.completed",
    ),
    "polar-mitm/messages": (
        "https://api.anthropic.com/v1/messages",
        {
            "model": "claude-sonnet-4-5",
            "system": "You are a coding agent.",
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": "Write the benchmark reply."}],
            "stream": True,
        },
        b"message_stop",
    ),
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


# -- the benchmark -------------------------------------------------------------------------------


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


def targets(
    tmp: Path,
    upstream: str,
    confdir: Path,
    ssl_ctx: ssl.SSLContext,
    mode: str,
    extra: tuple[str, ...] = (),
    sglang: dict[str, str] | None = None,
) -> dict:
    out = {"direct": Target(upstream + "/v1/chat/completions", None, False)}
    for column in (*COLUMNS[1:], *extra):  # all start at once; then each is waited for
        [(_, out[column])] = targets_for(tmp, column, upstream, confdir, ssl_ctx, mode, False)
    for column, url in (sglang or {}).items():  # polar-mitm, SGLang upstream
        options = {**POLAR_OPTIONS, "polar_upstream_kind": "sglang"}
        child, port = start_proxy(tmp, "polar-mitm", url, confdir, column[11:], options, False)
        out[column] = Target(URL, f"http://127.0.0.1:{port}", ssl_ctx, child)
    for t in out.values():
        if t.child is not None:
            t.child.wait_ready()
    polar = out["polar-mitm"]
    for column, (url, body, done) in DIALECT_CALLS.items():
        out[column] = Target(url, polar.proxy, ssl_ctx, None, body, done)  # the same proxy
    return out


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


async def interleaved(ts: dict[str, Target], sessions: int, rounds: int) -> dict[str, Run]:
    """Latency, fair across columns: every round makes one call per session on each column in
    turn, so all columns see the same machine load (drift on a shared box is larger than the
    differences measured). Sessions keep their connection across rounds, as harnesses do."""
    runs = {c: Run() for c in ts}
    pools = session_pools(ts, sessions)
    try:
        for r in range(rounds + 1):  # round 0 warms up: certificates, connections
            for column, t in ts.items():
                samples = await asyncio.gather(
                    *(
                        one_call(
                            s, t.url, t.proxy, t.ssl, f"bench-{column}.{i}", t.body, t.done, t.key
                        )
                        for i, s in enumerate(pools[column])
                    )
                )
                if r:
                    runs[column].samples += samples
                    runs[column].errors += sum(not x.ok for x in samples)
    finally:
        await close_pools(pools)
    return runs


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    from polar_mitm.certs import ensure_ca

    confdir = tmp / "certs"
    ca = ensure_ca(confdir)
    ssl_ctx = ssl.create_default_context(cafile=str(ca))
    scenario = write_scenario(tmp, args.tokens)
    paced = spawn_server(tmp, scenario, args.token_rate, "server-paced")
    fast = spawn_server(tmp, scenario, 0, "server-fast")
    sglang_servers = {
        column: spawn_server(tmp, scenario, args.token_rate, column[11:] + "-server", flags)
        for column, flags in SGLANG_COLUMNS.items()
    }
    paced_url, fast_url = server_url(paced), server_url(fast)
    sglang = {column: server_url(child) for column, child in sglang_servers.items()}
    litellm = litellm_bin(install=args.litellm)
    extra = ("litellm",) if litellm is not None and not args.smoke else ()
    extra += tuple(f"polar-mitm+{name}" for name in VARIANTS)
    if litellm is None:
        progress("no litellm column (scripts/bench.py --litellm installs it)")
    columns = {c: {} for c in COLUMNS + DIALECT_COLUMNS + tuple(SGLANG_COLUMNS) + extra}
    results: dict = {"config": vars(args), "columns": columns}
    cols = results["columns"]
    try:
        ts = targets(tmp, paced_url, confdir, ssl_ctx, "paced", extra, sglang)
        try:
            for conc, rounds in ((1, args.calls1), (32, args.calls32)):
                runs = asyncio.run(interleaved(ts, conc, rounds))
                for column, run in runs.items():
                    cols[column][f"c{conc}"] = summarize(run)
                progress(f"latency at {conc} concurrent: done")
        finally:
            for t in ts.values():
                if t.child is not None:
                    t.child.stop()
        throughput(args, tmp, COLUMNS + extra, fast_url, confdir, ssl_ctx, cols)
    finally:
        paced.stop()
        fast.stop()
        for child in sglang_servers.values():
            child.stop()
    results["inprocess"] = inprocess_figures(args)
    progress("in-process figures (store, merge, fidelity, exact-prefix): done")
    return results


def throughput(
    args: argparse.Namespace,
    tmp: Path,
    columns: tuple[str, ...],
    upstream: str,
    confdir: Path,
    ssl_ctx: ssl.SSLContext,
    cols: dict,
) -> None:
    """calls/s and CPU per call, upstream as fast as it goes: every column gets `args.slices`
    slices of 32 sessions, the columns taking turns (in a rotating order), so that a machine
    that slows down or speeds up part-way moves every column alike. (Timed one column after
    the other, the same code's calls/s ratio was 0.59, 0.67 and 0.73 in three --quick runs;
    taking turns, 0.73 and 0.72 in two.)
    A proxy's CPU is its whole CPU time from its first slice to a settle after the last (an
    idle proxy uses none): work a proxy does after its calls — e.g. polar-mitm writing the
    trajectories of rollouts that went idle — counts as its own."""
    ts: dict[str, Target] = {}
    try:
        for column in columns:  # all start at once; then each is waited for
            [(_, ts[column])] = targets_for(tmp, column, upstream, confdir, ssl_ctx, wait=False)
        for t in ts.values():
            if t.child is not None:
                t.child.wait_ready()
        loop = asyncio.new_event_loop()
        runs = {column: Run() for column in ts}
        for column, t in ts.items():  # warm up: certificates, connections
            loop.run_until_complete(drive(column, t.url, t.proxy, t.ssl, 4, 2, None, t.key))
        cpu0 = {c: t.child.cpu_seconds() for c, t in ts.items() if t.child is not None}
        order, seconds = list(ts), args.seconds / args.slices
        for r in range(args.slices):
            for column in order[r % len(order) :] + order[: r % len(order)]:
                t = ts[column]
                run = loop.run_until_complete(
                    drive(column, t.url, t.proxy, t.ssl, 32, None, seconds, t.key)
                )
                runs[column].samples += run.samples
                runs[column].errors += run.errors
                runs[column].wall += run.wall
        time.sleep(SETTLE_S)
        for column, run in runs.items():
            cols[column]["throughput"] = summarize(run)
            if column in cpu0:
                cpu = ts[column].child.cpu_seconds() - cpu0[column]
                cols[column]["throughput"]["cpu_s_per_1k_calls"] = 1000 * cpu / max(run.ok, 1)
        progress(f"throughput and CPU ({args.slices} turns of {len(ts)} columns): done")
        if args.rss_calls:
            polar = ts["polar-mitm"]
            assert polar.child is not None
            cols["polar-mitm"]["rss"] = rss_curve(
                loop, polar.url, polar.proxy, polar.ssl, polar.child, args.rss_calls
            )
            progress("RSS curve: done")
        loop.close()
    finally:
        for t in ts.values():
            if t.child is not None:
                t.child.stop()


def targets_for(
    tmp, column, upstream, confdir, ssl_ctx, mode: str = "fast", wait: bool = True
) -> list[tuple[str, Target]]:
    if column == "direct":
        return [(column, Target(upstream + "/v1/chat/completions", None, False))]
    if column == "litellm":  # a gateway at a base URL, not an HTTPS proxy
        child, port = start_litellm(tmp, upstream, f"litellm-{mode}", wait)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return [(column, Target(url, None, False, child, key=LITELLM_KEY))]
    options = POLAR_OPTIONS
    if column.startswith("polar-mitm+"):  # a --variant: polar-mitm with more settings
        options = {**POLAR_OPTIONS, **VARIANTS[column.removeprefix("polar-mitm+")]}
    name = f"{column}-{mode}"
    kind = "polar-mitm" if column.startswith("polar-mitm") else column
    child, port = start_proxy(tmp, kind, upstream, confdir, name, options, wait)
    return [(column, Target(URL, f"http://127.0.0.1:{port}", ssl_ctx, child))]


def rss_curve(loop, url, proxy, ctx, child: Child, total: int) -> list[tuple[int, float]]:
    """RSS after every tenth of `total` calls. Each tenth is a new set of 32 rollouts: the earlier
    ones go idle and end (`polar_rollout_idle`), as a farm's rollouts end, so what is measured
    is what the proxy keeps per call, not the trajectories of rollouts that are still open."""
    points = [(0, child.rss_mb())]
    step = max(total // 10, 1)
    done = 0
    while done < total:
        loop.run_until_complete(
            drive("polar-mitm", url, proxy, ctx, 32, max(step // 32, 1), None, tag=f"rss{done}")
        )
        done += max(step // 32, 1) * 32
        points.append((done, child.rss_mb()))
    return points


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


def inprocess_figures(args: argparse.Namespace) -> dict:
    """The figures other benchmarks measure in-process, when their modules are present."""
    out: dict = {}
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_store  # noqa: PLC0415

        rows = bench_store.make_rows(256 if args.smoke else 2048, 4000, 500)
        with tempfile.TemporaryDirectory() as d:
            raw_s = bench_store.bench_raw(rows, 512, d, False)[0]
        with tempfile.TemporaryDirectory() as d:
            store_s = bench_store.bench_store(rows, 512, d)[0]
        out["parquet_flush_vs_raw"] = raw_s / store_s
    except Exception as e:  # a benchmark that is not there (yet) or failed: say so
        out["parquet_flush_vs_raw"] = f"n/a ({type(e).__name__}: {e})"
    try:
        import bench_merge  # noqa: PLC0415

        out.update(bench_merge.figures(smoke=args.smoke))
    except Exception as e:
        out["merge"] = f"n/a ({type(e).__name__}: {e})"
    try:
        import bench_fidelity  # noqa: PLC0415

        out.update(bench_fidelity.figures(smoke=args.smoke))
    except Exception as e:
        out["fidelity"] = f"n/a ({type(e).__name__}: {e})"
    try:
        import bench_exact  # noqa: PLC0415

        out.update(bench_exact.figures(smoke=args.smoke))
    except Exception as e:
        out["exact_prefix"] = f"n/a ({type(e).__name__}: {e})"
    return out


# -- report --------------------------------------------------------------------------------------


def added(col: dict, direct: dict, key: str, p: str) -> float:
    return col[key][f"ttlb_ms_{p}"] - direct[key][f"ttlb_ms_{p}"]


def report(results: dict) -> list[tuple[str, str, str, str, str]]:
    cols = results["columns"]
    d, s, b, p, f = (cols[c] for c in COLUMNS)
    rows: list[tuple[str, str, str, str, str]] = []

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}" if y and y == y and x == x else "n/a"

    def ratios(x: float, floor: float, stream: float) -> str:
        """polar-mitm over the capture floor, and (in brackets) the capture floor over stream:
        how much of polar-mitm's ratio to mitm-stream is the price of capture itself."""
        return f"{ratio(x, floor)} ({ratio(floor, stream)})"

    lite = cols.get("litellm") or {}

    def and_litellm(value: Callable[[dict], float]) -> str:
        """The LiteLLM gateway's figure, when the column ran (a harness's base URL -> LiteLLM)."""
        try:
            return f" / litellm {value(lite):.1f}"
        except (KeyError, TypeError):
            return ""

    for conc in ("c1", "c32"):
        rows.append(
            (
                f"TTFB p50 ms ({conc[1:]} conc)",
                f"{p[conc]['ttfb_ms_p50']:.1f}",
                f"stream {s[conc]['ttfb_ms_p50']:.1f} / capture {f[conc]['ttfb_ms_p50']:.1f} / buffered {b[conc]['ttfb_ms_p50']:.1f} / direct {d[conc]['ttfb_ms_p50']:.1f}"
                + and_litellm(lambda c, conc=conc: c[conc]["ttfb_ms_p50"]),
                ratio(p[conc]["ttfb_ms_p50"], s[conc]["ttfb_ms_p50"]),
                ratios(p[conc]["ttfb_ms_p50"], f[conc]["ttfb_ms_p50"], s[conc]["ttfb_ms_p50"]),
            )
        )
        for q in ("p50", "p99"):
            rows.append(
                (
                    f"added latency {q} ms ({conc[1:]} conc)",
                    f"{added(p, d, conc, q):.1f}",
                    f"stream {added(s, d, conc, q):.1f} / capture {added(f, d, conc, q):.1f} / buffered {added(b, d, conc, q):.1f}"
                    + and_litellm(lambda c, conc=conc, q=q: added(c, d, conc, q)),
                    ratio(added(p, d, conc, q), added(s, d, conc, q)),
                    ratios(added(p, d, conc, q), added(f, d, conc, q), added(s, d, conc, q)),
                )
            )
    for column in (c for c in cols if c.startswith("polar-mitm+")):
        x = cols[column]
        for conc in ("c1", "c32"):
            for q in ("p50", "p99"):
                rows.append(
                    (
                        f"{column}: added latency {q} ms ({conc[1:]} conc)",
                        f"{added(x, d, conc, q):.1f}",
                        f"polar-mitm {added(p, d, conc, q):.1f} / stream {added(s, d, conc, q):.1f}",
                        ratio(added(x, d, conc, q), added(s, d, conc, q)),
                        ratios(added(x, d, conc, q), added(f, d, conc, q), added(s, d, conc, q)),
                    )
                )
        through = x["throughput"]
        rows.append(
            (
                f"{column}: calls/s; CPU-s per 1k calls",
                f"{through['calls_per_s']:.1f}; {through['cpu_s_per_1k_calls']:.1f}",
                f"polar-mitm {p['throughput']['calls_per_s']:.1f}; {p['throughput']['cpu_s_per_1k_calls']:.1f}",
                f"{ratio(through['calls_per_s'], s['throughput']['calls_per_s'])}; "
                f"{ratio(through['cpu_s_per_1k_calls'], s['throughput']['cpu_s_per_1k_calls'])}",
                "",
            )
        )
    for column in DIALECT_COLUMNS:
        x = cols.get(column) or {}
        for conc in ("c1", "c32"):
            if conc not in x:
                continue
            rows.append(
                (
                    f"{column.split('/')[1]}: TTLB p50 ms ({conc[1:]} conc)",
                    f"{x[conc]['ttlb_ms_p50']:.1f}",
                    f"polar-mitm chat {p[conc]['ttlb_ms_p50']:.1f} (TTFB {x[conc]['ttfb_ms_p50']:.1f} vs {p[conc]['ttfb_ms_p50']:.1f})",
                    ratio(x[conc]["ttlb_ms_p50"], p[conc]["ttlb_ms_p50"]),
                    "",
                )
            )
    sg, old = cols.get("polar-mitm/sglang") or {}, cols.get("polar-mitm/sglang-nostream") or {}
    for conc in ("c1", "c32"):
        if conc not in sg or conc not in old:
            continue
        rows.append(
            (
                f"sglang: TTFB p50 ms ({conc[1:]} conc)",
                f"{sg[conc]['ttfb_ms_p50']:.1f}",
                f"vLLM (polar-mitm chat) {p[conc]['ttfb_ms_p50']:.1f} / sglang without sglext "
                f"{old[conc]['ttfb_ms_p50']:.1f} (TTLB {sg[conc]['ttlb_ms_p50']:.1f} vs "
                f"{old[conc]['ttlb_ms_p50']:.1f})",
                ratio(sg[conc]["ttfb_ms_p50"], p[conc]["ttfb_ms_p50"]),
                "",
            )
        )
    rows.append(
        (
            "calls/s (32 conc, fast upstream)",
            f"{p['throughput']['calls_per_s']:.1f}",
            f"stream {s['throughput']['calls_per_s']:.1f} / capture {f['throughput']['calls_per_s']:.1f} / buffered {b['throughput']['calls_per_s']:.1f} / direct {d['throughput']['calls_per_s']:.1f}"
            + and_litellm(lambda c: c["throughput"]["calls_per_s"]),
            ratio(p["throughput"]["calls_per_s"], s["throughput"]["calls_per_s"]),
            ratios(
                p["throughput"]["calls_per_s"],
                f["throughput"]["calls_per_s"],
                s["throughput"]["calls_per_s"],
            ),
        )
    )
    rows.append(
        (
            "proxy CPU-s per 1k calls",
            f"{p['throughput']['cpu_s_per_1k_calls']:.1f}",
            f"stream {s['throughput']['cpu_s_per_1k_calls']:.1f} / capture {f['throughput']['cpu_s_per_1k_calls']:.1f} / buffered {b['throughput']['cpu_s_per_1k_calls']:.1f}"
            + and_litellm(lambda c: c["throughput"]["cpu_s_per_1k_calls"]),
            ratio(p["throughput"]["cpu_s_per_1k_calls"], s["throughput"]["cpu_s_per_1k_calls"]),
            ratios(
                p["throughput"]["cpu_s_per_1k_calls"],
                f["throughput"]["cpu_s_per_1k_calls"],
                s["throughput"]["cpu_s_per_1k_calls"],
            ),
        )
    )
    if p.get("rss"):
        first, last = p["rss"][1][1], p["rss"][-1][1]
        rows.append(
            (
                f"proxy RSS MB after {p['rss'][1][0]} -> {p['rss'][-1][0]} calls",
                f"{first:.0f} -> {last:.0f}",
                "",
                ratio(last, first),
                "",
            )
        )
    for key, value in results["inprocess"].items():
        rows.append((key, f"{value:.2f}" if isinstance(value, float) else str(value), "", "", ""))
    return rows


HEADER = ("figure", "polar-mitm", "floor / others", "ratio", "vs capture-floor (its ratio)")


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...] = HEADER) -> None:
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    names = [c for c in results["columns"] if "c1" in results["columns"][c]]
    for ax, conc in zip(axes, ("c1", "c32"), strict=True):
        data = [results["columns"][c][conc]["ttlb_ms"] or [0] for c in names]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=25, fontsize=8)
        ax.set_ylabel("time to last byte (ms)")
        ax.set_title(f"{conc[1:]} concurrent session(s), paced upstream")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def long_main(args: argparse.Namespace) -> int:
    """`--long`: the long-session load, its table and --json figures."""
    import bench_long  # noqa: PLC0415 - scripts/ is on sys.path

    small = (2, 4) if args.smoke else (4, 12) if args.quick else (8, 30)
    args.long_sessions = args.sessions or small[0]
    args.long_turns = args.turns or small[1]
    args.open_rollouts = 8 if args.smoke else 64 if args.quick else 256
    args.open_turns = 1 if args.smoke or args.quick else 2
    with tempfile.TemporaryDirectory(prefix="polar-bench-long-") as d:
        results = bench_long.measure_long(args, Path(d))
    with tempfile.TemporaryDirectory(prefix="polar-bench-open-") as d:
        results["open_rollouts"] = bench_long.measure_open_rollouts(args, Path(d))
    results["table"] = rows = bench_long.report_long(results)
    print_table(rows, bench_long.HEADER)
    if not args.no_vllm:  # the real-vLLM column (scripts/bench_vllm.py); skipped if not set up
        import bench_vllm  # noqa: PLC0415 - scripts/ is on sys.path

        with tempfile.TemporaryDirectory(prefix="polar-bench-vllm-") as d:
            results["vllm"] = bench_vllm.measure_vllm(args, Path(d))
        print()
        print_table(bench_vllm.report_vllm(results["vllm"]), bench_vllm.HEADER)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer calls (a few minutes on 2 cores)")
    ap.add_argument("--smoke", action="store_true", help="tiny counts, to check the script runs")
    ap.add_argument(
        "--json", type=Path, default=None, help="write the figures here (and a .png beside it)"
    )
    ap.add_argument(
        "--token-rate", type=float, default=30.0, help="paced upstream tokens/s per stream"
    )
    ap.add_argument("--tokens", type=int, default=None, help="tokens per reply")
    ap.add_argument(
        "--litellm",
        action="store_true",
        help=f"install LiteLLM's proxy ({LITELLM_VERSION}, into .venv-litellm) when missing; "
        "its column is there whenever .venv-litellm is",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="one more polar-mitm column with these --set options, e.g. "
        "nohold:polar_durable_replies=false (repeatable)",
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help="the long-session load instead (scripts/bench_long.py): agent sessions that re-send "
        "a growing conversation, 8 sessions x 30 turns (--quick 4 x 12); then RSS with 256 "
        "open rollouts of 2 turns (--quick 64 of 1)",
    )
    ap.add_argument(
        "--no-vllm",
        action="store_true",
        help="--long: leave out the real-vLLM column (scripts/bench_vllm.py)",
    )
    ap.add_argument("--sessions", type=int, default=None, help="--long: concurrent sessions")
    ap.add_argument("--turns", type=int, default=None, help="--long: turns per session")
    ap.add_argument(
        "--markdown",
        action="store_true",
        help="also print the table as Markdown, goals judged (what the README shows)",
    )
    args = ap.parse_args()
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        if not re.fullmatch(r"[\w.-]+", name):
            ap.error(f"--variant {spec!r}: the name takes letters, digits, '.', '_', '-'")
        pairs = [kv.split("=", 1) for kv in sets.split(",") if kv]
        if not pairs or any(len(kv) != 2 for kv in pairs):
            ap.error(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        VARIANTS[name] = dict(pairs)
    if args.long:
        return long_main(args)
    args.slices = 1 if args.smoke else 4
    if args.smoke:
        args.tokens, args.calls1, args.calls32, args.seconds, args.rss_calls = (
            args.tokens or 8,
            3,
            1,
            1.5,
            64,
        )
        args.token_rate = 200.0
    elif args.quick:
        args.tokens, args.calls1, args.calls32, args.seconds, args.rss_calls = (
            args.tokens or 8,
            7,
            3,
            4.0,
            1280,
        )
    else:
        args.tokens, args.calls1, args.calls32, args.seconds, args.rss_calls = (
            args.tokens or 30,
            40,
            6,
            20.0,
            10000,
        )
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as d:
        results = measure(args, Path(d))
    rows = report(results)
    print_table(rows)
    if args.markdown:
        from bench_markdown import markdown  # noqa: PLC0415 - scripts/ is on sys.path

        print("\n" + markdown(results))
    results["table"] = rows
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        plot(results, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
