"""The benchmarks (polar_bench) must not rot: run their scenarios with tiny counts and check they
produced numbers."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT


def run_bench(scenario: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """`python -m polar_bench SCENARIO ARGS` from the checkout's root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "polar_bench", scenario, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(
        "chat",
        "--quick",
        "--smoke",
        "--variant",
        "nohold:polar_durable_replies=false",
        "--json",
        str(out),
        "--markdown",
    )
    results = json.loads(out.read_text())
    assert results["scenario"] == "chat" and results["machine"]["cpus"] > 0  # what it ran on
    assert results["machine"]["versions"]["mitmproxy"]
    for column in ("direct", "mitm-stream", "mitm-buffered", "polar-mitm", "capture-floor"):
        col = results["columns"][column]
        assert col["c1"]["calls"] > 0 and col["throughput"]["calls"] > 0, (column, col)
        assert col["c1"]["ttfb_ms_p50"] > 0
    for column in ("polar-mitm", "capture-floor"):  # CPU from /proc
        assert results["columns"][column]["throughput"]["cpu_s_per_1k_calls"] > 0
    for column in ("polar-mitm/responses", "polar-mitm/messages"):  # Codex's and Claude's APIs
        col = results["columns"][column]
        assert col["c1"]["calls"] > 0 and col["c1"]["errors"] == 0, (column, col)
    for column in ("polar-mitm/sglang", "polar-mitm/sglang-nostream"):  # SGLang upstreams
        col = results["columns"][column]
        assert col["c1"]["calls"] > 0 and col["c1"]["errors"] == 0, (column, col)
        assert col["c1"]["ttfb_ms_p50"] > 0
    assert "sglang: TTFB p50 ms (1 conc)" in proc.stdout
    nohold = results["columns"]["polar-mitm+nohold"]  # --variant: one more polar-mitm column
    assert nohold["c1"]["calls"] > 0 and nohold["throughput"]["cpu_s_per_1k_calls"] > 0
    assert "polar-mitm+nohold: added latency p50 ms (1 conc)" in proc.stdout
    assert isinstance(results["inprocess"]["parquet_flush_vs_raw"], float)
    assert isinstance(results["inprocess"]["merge_time_2N_over_N"], float)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "added latency p50 ms (1 conc)" in proc.stdout
    assert "| calls/s, 32 concurrent |" in proc.stdout  # --markdown: the README's table
    assert results["inprocess"]["fidelity_check_vs_off"] > 1  # polar_bench/fidelity.py
    assert results["inprocess"]["exact_hot_ms_cpu_per_call"] > 0  # polar_bench/exact.py


def test_bench_long_smoke(tmp_path):
    """The long-session load: 2 sessions x 4 turns, 8 open rollouts."""
    out = tmp_path / "long.json"
    proc = run_bench("long", "--smoke", "--json", str(out))
    results = json.loads(out.read_text())
    cols = results["columns"]
    exact = ("polar-mitm+exact", "polar-mitm+exact+buffer")  # relayed, and whole replies
    for column in ("direct", "mitm-stream", "capture-floor", "polar-mitm", *exact):
        assert cols[column]["calls"] == 8 and cols[column]["errors"] == 0, (column, cols[column])
    assert cols["polar-mitm@half"]["calls"] == 4  # stopped at half the turns
    assert "exact-prefix: proxy CPU per call" in proc.stdout  # its goals' rows
    assert "exact-prefix, buffered: first byte p50" in proc.stdout
    for column in exact:
        assert cols[column]["token_in_calls"] == 2 * 3  # all but each session's first
    assert cols["polar-mitm"]["token_in_calls"] == 0
    for column in ("mitm-stream", "capture-floor", "polar-mitm", *exact):
        assert cols[column]["cpu_ms_per_call"] > 0 and cols[column]["peak_rss_mb"] > 0
    polar = cols["polar-mitm"]
    assert polar["traces_per_rollout"] == 1.0  # the merge saw each session as one conversation
    # every call after a session's first is stored as what it adds (schema 2), and smaller
    assert polar["calls_with_base"] == 2 * 3, polar
    assert polar["calls_bytes"] < polar["calls_bytes_whole_rows"]["zstd (the store's settings)"]
    assert 0 < polar["bytes_per_token"] < 20
    assert results["open_rollouts"]["unique_tokens"] > 8 * 10_000  # 8 first calls of ~12k tokens
    assert "bytes on disk per token of the final conversations" in proc.stdout


def test_profile_parts_name_real_functions():
    """polar_bench/profiling.py finds each part by its function's name in py-spy's stacks; a
    renamed function would silently show 0 %."""
    import importlib
    import inspect
    import pkgutil

    import polar_mitm
    from polar_bench import profiling as bench_profile

    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(polar_mitm.__path__, "polar_mitm.")
        if not m.name.startswith("polar_reference")
    ]
    modules += [importlib.import_module(n) for n in ("aiohttp.client", "mitmproxy.addonmanager")]
    known = set()
    for module in modules:
        for _, obj in inspect.getmembers(module):
            if inspect.isfunction(obj) or inspect.isclass(obj):
                known.add(obj.__qualname__)
                if inspect.isclass(obj):
                    known.update(f"{obj.__qualname__}.{name}" for name in vars(obj))
    missing = [fn for fn in bench_profile.PARTS.values() if fn not in known]
    assert not missing, missing


def test_bench_exact_long_smoke():
    """polar_bench/exact.py --long (exact-prefix's hot path on the long load's sessions)."""
    proc = run_bench("exact", "--long", "--turns", "3", timeout=300)
    figures = dict(line.split() for line in proc.stdout.splitlines() if line.startswith("long_"))
    assert float(figures["long_last_plan_ms"]) > 0
    assert float(figures["long_last_encode_ms"]) > 0


def test_bench_long_ab_gateway_smoke():
    """polar_bench/long_ab.py with its mitm-stream and mitm-gateway columns (the latter:
    polar_bench/floor_addon.py's BENCH_GATEWAY, calls through polar-mitm's loopback gateway)."""
    args = ("--tree", f"new={ROOT}", "--stream", "--gateway", "--sessions", "1", "--turns", "2")
    proc = run_bench("long-ab", *args)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if " calls " in line}
    for column in ("polar-mitm+exact-new", "mitm-stream", "mitm-gateway"):
        assert rows[column][1:3] == ["calls", "2"], proc.stdout
    assert "ms/call" in " ".join(rows["mitm-gateway"]), proc.stdout
