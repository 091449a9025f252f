#!/usr/bin/env python
"""Two code trees' proxies side by side under python -m polar_bench long's load, per thread.

    python -m polar_bench long-ab --tree base=/tmp/main-copy --tree new=. \\
        [--sessions 8] [--turns 20] [--chat] [--stream]

    git archive main | tar -x -C /tmp/main-copy    # a tree to compare against

Each tree's polar-mitm proxy in exact-prefix mode (`--chat`: in chat mode too; `--stream`: plain
mitm-stream beside them) runs the long sessions of polar_bench/long.py at once, the columns
taking turns each turn in a rotating order (`bench_long.run_load`), so that a shared machine's
load moves them alike: the way to see a change of a few tenths of a millisecond per call.
`--gateway` adds mitm-stream sent through polar-mitm's loopback gateway, nothing else
(polar_bench/floor_addon.py, BENCH_GATEWAY): the floor of a proxy built as polar-mitm is. Prints
per column the calls, the late-turn latency p50, the proxy's CPU per call and peak RSS, and the
CPU seconds of each of its threads over the load (thread ids in start order: the event loop
first, then polar-mitm's `polar-store-journal`, `polar-store-shards`, `polar-exact_0` and
`polar-fidelity_0`, as `py-spy dump --pid PID` names them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import tempfile
import time
from pathlib import Path

from . import core
from . import long as bench_long


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class Snapshots(core.Child):
    """A proxy whose every CPU reading also keeps its threads' (`run_load` reads it at the
    start and at the end of the load)."""

    snaps: list[dict[str, float]]

    def cpu_seconds(self) -> float:
        self.snaps = [*getattr(self, "snaps", []), thread_cpu(self.proc.pid)]
        return super().cpu_seconds()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--chat", action="store_true", help="each tree in chat mode too")
    ap.add_argument("--stream", action="store_true", help="a mitm-stream column too")
    ap.add_argument(
        "--gateway",
        action="store_true",
        help="a mitm-gateway column too: mitm-stream through polar-mitm's loopback gateway",
    )
    args = ap.parse_args(argv)
    from polar_mitm.certs import ensure_ca

    print(f"load average {os.getloadavg()}")
    core.Child = Snapshots  # start_proxy's children keep their threads' readings
    with tempfile.TemporaryDirectory(prefix="polar-ab-") as d:
        tmp = Path(d)
        confdir = tmp / "certs"
        ctx = ssl.create_default_context(cafile=str(ensure_ca(confdir)))
        scenario = bench_long.write_scenario(tmp, args.turns)
        server, url = core.start_server(tmp, scenario, 0, "server")
        ts = {"direct": core.Target(url + "/v1/chat/completions", None, False)}
        children = []
        root = core.ROOT
        try:
            columns = []
            for spec in args.tree:
                name, path = spec.split("=", 1)
                columns.append((f"polar-mitm+exact-{name}", path, "polar-mitm+exact"))
                if args.chat:
                    columns.append((f"polar-mitm-{name}", path, "polar-mitm"))
            if args.stream:
                columns.append(("mitm-stream", str(root), None))
            if args.gateway:
                columns.append(("mitm-gateway", str(root), None))
            for column, path, options in columns:
                core.ROOT = Path(path).resolve()  # start_proxy runs that tree's addon
                kind = "polar-mitm" if options else column
                opts = bench_long.column_options(options) if options else None
                name = column.replace("+", "-")
                child, port = core.start_proxy(tmp, kind, url, confdir, name, opts, wait=False)
                children.append(child)
                ts[column] = core.Target(core.URL, f"http://127.0.0.1:{port}", ctx, child)
            core.ROOT = root
            for child in children:
                child.wait_ready()
            t0 = time.perf_counter()
            samples, cpu, _ = asyncio.run(bench_long.run_load(ts, args.sessions, args.turns))
            wall = time.perf_counter() - t0
            fifth = max(args.turns // 5, 1)
            for column, per_turn in samples.items():
                ok = [s for turn in per_turn for s in turn if s.ok]
                late = bench_long.p50([s.ttlb for turn in per_turn[-fifth:] for s in turn if s.ok])
                line = f"{column:28s} calls {len(ok):4d}  late p50 {1000 * late:6.1f} ms"
                child = ts[column].child
                if child is not None:
                    per_call = 1000 * cpu[column] / max(len(ok), 1)
                    rss = bench_long.peak_rss_mb(child)
                    before, after = child.snaps[0], child.snaps[-1]
                    threads = " ".join(
                        f"{tid}:{after[tid] - before.get(tid, 0):.2f}"
                        for tid in sorted(after, key=int)
                        if after[tid] - before.get(tid, 0) >= 0.01
                    )
                    line += f"  CPU {per_call:6.2f} ms/call  peak RSS {rss:.0f} MB\n    threads (s): {threads}"
                print(line)
            print(f"wall {wall:.0f} s, load average {os.getloadavg()}")
        finally:
            for child in children:
                child.stop()
            server.stop()


if __name__ == "__main__":
    main()
