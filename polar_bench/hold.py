"""What the durable hold costs when many calls end at once (issue 24's last goal).

`polar_durable_replies` holds each completed reply's last event until its record is fsynced in the
journal. In a GRPO farm the calls of a group start together and end together, so the hold is paid
when the journal is busiest. This runs exactly that: `--sessions` short chats (one keep-alive
connection each) start at the same moment every round, against three proxies in turn (rotating
order, so machine drift moves them alike). The polar-mitm columns load the Qwen3 tokenizer, as a
farm does, so the hold covers each record's fidelity checks as well as its fsync:

  polar-mitm         the addon as shipped (hold on)
  polar-mitm/nohold  the same with polar_durable_replies=false
  mitm-stream        plain streaming mitmdump (the floor)

Figures: time to last byte p50 / p99 of each column, the hold's cost end to end (hold minus
nohold, paired round by round), and the hold itself as the proxy measures it
(`polar_durable_hold_seconds` on its /metrics: mean and median from the histogram). The proxy's
figure is the longer one: it counts the event loop's queue (each call's end also waits behind the
other calls' end-of-call work, which nohold does not skip either, only reorders).

    python -m polar_bench hold              # 32 sessions x 20 rounds, about 2 min
    python -m polar_bench hold --rounds 3   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.certs import ensure_ca
from polar_mitm.cli.top import quantile, scrape

from . import core


async def rounds(ts: dict[str, core.Target], sessions: int, n: int) -> dict[str, list[list]]:
    """``n`` rounds (after one warm-up); in each, every column gets ``sessions`` calls at once."""
    out: dict[str, list[list]] = {c: [] for c in ts}
    pools = core.session_pools(ts, sessions)
    order = list(ts)
    try:
        for r in range(n + 1):
            for column in order[r % len(order) :] + order[: r % len(order)]:
                t = ts[column]
                samples = await asyncio.gather(
                    *(
                        core.one_call(s, t.url, t.proxy, t.ssl, f"hold-{column}.{r}.{i}")
                        for i, s in enumerate(pools[column])
                    )
                )
                if r:
                    out[column].append(samples)
            core.progress(f"round {r}/{n}")
    finally:
        await core.close_pools(pools)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=30, help="tokens per reply")
    ap.add_argument("--token-rate", type=float, default=30.0, help="paced tokens/s per stream")
    ap.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="no polar_tokenizer (by default the Qwen3 tokenizer: the checks run before the store)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="polar-hold-") as d:
        tmp = Path(d)
        confdir = tmp / "certs"
        ssl_ctx = core.ssl.create_default_context(cafile=str(ensure_ca(confdir)))
        server = core.spawn_server(
            tmp, core.write_scenario(tmp, args.tokens), args.token_rate, "server"
        )
        upstream = core.server_url(server)
        control = core.free_port()
        polar = dict(core.POLAR_OPTIONS)
        if not args.no_tokenizer:
            polar["polar_tokenizer"] = str(qwen3_tokenizer_dir())
        columns = {
            "polar-mitm": {
                **polar,
                "polar_control_listen": str(control),
                "polar_metrics_public": "true",
            },
            "polar-mitm/nohold": {**polar, "polar_durable_replies": "false"},
            "mitm-stream": None,
        }
        ts: dict[str, core.Target] = {}
        try:
            for column, options in columns.items():
                kind = "mitm-stream" if options is None else "polar-mitm"
                name = column.replace("/", "-")
                child, port = core.start_proxy(
                    tmp, kind, upstream, confdir, name, options, wait=False
                )
                ts[column] = core.Target(core.URL, f"http://127.0.0.1:{port}", ssl_ctx, child)
            for t in ts.values():
                t.child.wait_ready()
            before = scrape(f"http://127.0.0.1:{control}", None)
            runs = asyncio.run(rounds(ts, args.sessions, args.rounds))
            after = scrape(f"http://127.0.0.1:{control}", None)
        finally:
            core.stop_targets(ts)
            server.stop()
    result = figures(runs, before, after)
    result["config"] = {k: str(v) for k, v in vars(args).items()}
    for key, value in result.items():
        if key != "config":
            print(f"{key:48} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def figures(runs: dict[str, list[list]], before, after) -> dict:
    def ttlb(column: str, q: float) -> float:
        values = sorted(s.ttlb for rnd in runs[column] for s in rnd if s.ok)
        return 1000 * values[min(len(values) - 1, int(q * len(values)))]

    out: dict = {}
    for column in runs:
        errors = sum(not s.ok for rnd in runs[column] for s in rnd)
        out[f"{column}: TTLB p50 / p99 ms"] = f"{ttlb(column, 0.5):.1f} / {ttlb(column, 0.99):.1f}"
        out[f"{column}: errors"] = errors
    # paired by round: the hold's cost is the difference of the two columns' round medians
    diffs = [
        1000
        * (
            statistics.median(s.ttlb for s in a if s.ok)
            - statistics.median(s.ttlb for s in b if s.ok)
        )
        for a, b in zip(runs["polar-mitm"], runs["polar-mitm/nohold"], strict=True)
    ]
    q1, q2, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
    out["hold minus nohold by round, median [IQR] ms"] = f"{q2:.1f} [{q1:.1f}, {q3:.1f}]"
    out["hold_minus_nohold_ms"] = round(q2, 2)
    name = "polar_durable_hold_seconds"
    count = after.total(f"{name}_count") - before.total(f"{name}_count")
    total = after.total(f"{name}_sum") - before.total(f"{name}_sum")
    out["hold as the proxy measures it: calls"] = int(count)
    out["hold as the proxy measures it: mean ms"] = (
        round(1000 * total / count, 2) if count else None
    )
    p50 = quantile(after, name, 0.5)
    out["hold as the proxy measures it: p50 ms (histogram)"] = (
        round(1000 * p50, 2) if p50 is not None else None
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
