"""Short chats: what polar-mitm costs a rollout farm beside the alternatives, in one run.

Columns (same client, same upstream, same run):
  direct            client -> reference policy server over loopback HTTP (the physical limit)
  mitm-stream       plain mitmdump with polar_bench/floor_addon.py: api.openai.com -> server, reply
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

    python -m polar_bench chat --quick            # a few minutes on 2 cores
    python -m polar_bench chat --quick --smoke    # tiny counts: only checks that it runs
    python -m polar_bench chat --json out.json    # and out.png beside it
    python -m polar_bench chat --quick --markdown # and the Markdown table
    python -m polar_bench chat --quick --variant nohold:polar_durable_replies=false
                                                  # one more polar-mitm column, other settings
    python -m polar_bench long [--quick]          # long agent sessions instead (long.py)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .core import (
    POLAR_OPTIONS,
    ROOT,
    SETTLE_S,
    URL,
    Child,
    Run,
    Target,
    close_pools,
    drive,
    free_port,
    one_call,
    print_table,
    progress,
    save,
    server_url,
    session_pools,
    spawn_server,
    start_proxy,
    stop_targets,
    summarize,
    write_scenario,
)

COLUMNS = ("direct", "mitm-stream", "mitm-buffered", "polar-mitm", "capture-floor")
# The other harness dialects, through the same polar-mitm proxy (latency only: the floors and the
# server speak chat completions alone, so their yardstick is polar-mitm's own chat column).
DIALECT_COLUMNS = ("polar-mitm/responses", "polar-mitm/messages")
# polar-mitm with an SGLang upstream: each its own paced reference server (these server flags).
SGLANG_COLUMNS: dict[str, tuple[str, ...]] = {
    "polar-mitm/sglang": ("--kind", "sglang"),
    "polar-mitm/sglang-nostream": ("--kind", "sglang", "--no-sglext"),
}
# --variant NAME:KEY=VALUE,...: more polar-mitm columns with other settings (what one costs).
VARIANTS: dict[str, dict[str, str]] = {}


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
            sys.exit(f"polar_bench chat: installing LiteLLM failed:\n{pip.stderr[-3000:]}")
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


# -- the benchmark -------------------------------------------------------------------------------


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
        progress("no litellm column (python -m polar_bench chat --litellm installs it)")
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
            stop_targets(ts)
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
        stop_targets(ts)


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


def inprocess_figures(args: argparse.Namespace) -> dict:
    """The figures other benchmarks measure in-process, when their modules are present."""
    out: dict = {}
    try:
        from . import store as bench_store

        rows = bench_store.make_rows(256 if args.smoke else 2048, 4000, 500)
        with tempfile.TemporaryDirectory() as d:
            raw_s = bench_store.bench_raw(rows, 512, d, False)[0]
        with tempfile.TemporaryDirectory() as d:
            store_s = bench_store.bench_store(rows, 512, d)[0]
        out["parquet_flush_vs_raw"] = raw_s / store_s
    except Exception as e:  # a benchmark that is not there (yet) or failed: say so
        out["parquet_flush_vs_raw"] = f"n/a ({type(e).__name__}: {e})"
    try:
        from . import merge as bench_merge

        out.update(bench_merge.figures(smoke=args.smoke))
    except Exception as e:
        out["merge"] = f"n/a ({type(e).__name__}: {e})"
    try:
        from . import fidelity as bench_fidelity

        out.update(bench_fidelity.figures(smoke=args.smoke))
    except Exception as e:
        out["fidelity"] = f"n/a ({type(e).__name__}: {e})"
    try:
        from . import exact as bench_exact

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


def main(argv: list[str] | None = None) -> int:
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
        "--markdown",
        action="store_true",
        help="also print the table as Markdown, goals judged (what the README shows)",
    )
    args = ap.parse_args(argv)
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        if not re.fullmatch(r"[\w.-]+", name):
            ap.error(f"--variant {spec!r}: the name takes letters, digits, '.', '_', '-'")
        pairs = [kv.split("=", 1) for kv in sets.split(",") if kv]
        if not pairs or any(len(kv) != 2 for kv in pairs):
            ap.error(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        VARIANTS[name] = dict(pairs)
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
    print_table(rows, HEADER)
    if args.markdown:
        from .markdown import markdown

        print("\n" + markdown(results))
    results["table"] = rows
    if args.json:
        plot(results, args.json.with_suffix(".png"))
        save(without_samples(results), args.json, "chat", sys.argv[1:] if argv is None else argv)
    return 0


def without_samples(results: dict) -> dict:
    """The figures without each call's time to last byte (the plot has them): a saved run is
    kept small enough to commit (polar_bench/runs/)."""

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "ttlb_ms"}
        return value

    return strip(results)


if __name__ == "__main__":
    sys.exit(main())
