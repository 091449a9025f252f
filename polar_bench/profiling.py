#!/usr/bin/env python
"""Where the proxy's time goes: py-spy samples polar-mitm's event loop under polar_bench/chat.py's
throughput load (32 concurrent streaming chat calls, upstream as fast as it goes).

    .venv/bin/pip install py-spy      # not a test dependency
    python -m polar_bench profile [--seconds 12] [--tokens 8] [--raw out.txt]
    python -m polar_bench profile --long [--sessions 4] [--turns 12] [--exact]
                                      # under python -m polar_bench long's load instead (--exact:
                                      # its polar-mitm+exact column, exact-prefix mode;
                                      # --buffer: the column buffered)
    ... [--gil]                       # only the thread holding the GIL: Python's own CPU (a
                                      # thread blocked in C, e.g. a queue wait, is not sampled)

Prints the share of the main thread's samples (the event loop, where every call's work runs)
spent inside each part of the capture path, and the calls/s reached while sampling (lower than
polar_bench/chat.py's: py-spy itself takes a share of the 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

from . import core

# What each share means (function names as py-spy reports them).
PARTS = {
    "the whole gateway: one captured call, upstream request to last byte": "_Connection._serve",
    "  relaying the stream (parse, capture, translate, write)": "Call._relay_stream",
    "    decoding each upstream chunk (JSON)": "json_chunk",
    "    the harness's chunk (dialect translation, JSON)": "_ChatStream.chunk",
    "    finishing the call (record, merge, checks, journal hand-off)": "Call._complete",
    "  opening the upstream request (aiohttp client)": "_BaseRequestContextManager.__aenter__",
    "the request hook (parse the harness's body, record, reroute)": "CaptureAddon.request",
    "mitmproxy's hooks (every addon's, the request hook above included)": (
        "AddonManager.trigger_event"
    ),
}


def shares(raw: Path) -> tuple[int, dict[str, float]]:
    """Main-thread samples, and the share of them under each function of PARTS."""
    main = 0
    under: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].startswith("<module>"):  # worker threads: journal, shards, checks
            continue
        n = int(count)
        main += n
        names = {f.split(" (")[0] for f in frames}
        for fn in PARTS.values():
            if fn in names:
                under[fn] += n
    return main, {fn: under[fn] / main if main else 0.0 for fn in PARTS.values()}


def top_leaves(raw: Path, n: int = 15) -> list[tuple[float, str]]:
    """The functions where the samples of every thread were (self time), largest share first."""
    total = 0
    leaf: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        leaf[
            frames[-1].split(" (")[0] + (" [main]" if frames[0].startswith("<module>") else "")
        ] += int(count)
    return [(c / total, f) for f, c in leaf.most_common(n)] if total else []


def profile_long(args: argparse.Namespace, spy: str) -> int:
    """py-spy on polar-mitm under the long-session load (polar_bench/long.py), every thread."""
    from . import long as bench_long

    with tempfile.TemporaryDirectory(prefix="polar-profile-long-") as d:
        tmp = Path(d)
        from polar_mitm.certs import ensure_ca

        ctx = ssl.create_default_context(cafile=str(ensure_ca(tmp / "certs")))
        scenario = bench_long.write_scenario(tmp, args.turns)
        server, url = core.start_server(tmp, scenario, 0, "server")
        column = "polar-mitm+exact" if args.exact else "polar-mitm"
        column += "+buffer" if args.buffer else ""
        proxy, port = core.start_proxy(
            tmp,
            "polar-mitm",
            url,
            tmp / "certs",
            "long-polar-mitm",
            bench_long.column_options(column),
        )
        raw = args.raw or tmp / "samples.txt"
        ts = {
            "direct": core.Target(url + "/v1/chat/completions", None, False),
            column: core.Target(core.URL, f"http://127.0.0.1:{port}", ctx, proxy),
        }
        try:
            sampler = subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    str(proxy.proc.pid),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "-r",
                    "200",
                    *(["--gil"] if args.gil else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            asyncio.run(bench_long.run_load(ts, args.sessions, args.turns))
            sampler.send_signal(signal.SIGINT)
            if sampler.wait(60) not in (0, -signal.SIGINT):
                sys.exit(f"polar_bench profile: py-spy failed: {sampler.stderr.read()[-2000:]}")
        finally:
            proxy.stop()
            server.stop()
        total, part = shares(raw)
        leaves = top_leaves(raw)
    mode = ("exact-prefix mode" if args.exact else "chat mode") + (
        ", buffered" if args.buffer else ""
    )
    print(f"{mode}, {args.sessions} sessions x {args.turns} turns; {total} main-thread samples")
    for label, fn in PARTS.items():
        print(f"{100 * part[fn]:5.1f} %  {label}")
    print("self time, every thread ([main]: the event loop):")
    for share, fn in leaves:
        print(f"{100 * share:5.1f} %  {fn}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per reply")
    ap.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    ap.add_argument("--long", action="store_true", help="the long-session load instead")
    ap.add_argument("--sessions", type=int, default=4, help="--long: concurrent sessions")
    ap.add_argument("--turns", type=int, default=12, help="--long: turns per session")
    ap.add_argument("--exact", action="store_true", help="--long: exact-prefix mode's column")
    ap.add_argument(
        "--buffer",
        action="store_true",
        help="--long: the column buffered (polar_upstream_stream=buffer)",
    )
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    args = ap.parse_args(argv)
    spy = shutil.which("py-spy", path=str(core.BIN)) or shutil.which("py-spy")
    if spy is None:
        sys.exit("polar_bench profile: py-spy is not installed (.venv/bin/pip install py-spy)")
    if args.long:
        return profile_long(args, spy)
    with tempfile.TemporaryDirectory(prefix="polar-profile-") as d:
        tmp = Path(d)
        from polar_mitm.certs import ensure_ca

        ctx = ssl.create_default_context(cafile=str(ensure_ca(tmp / "certs")))
        server, url = core.start_server(tmp, core.write_scenario(tmp, args.tokens), 0, "server")
        proxy, port = core.start_proxy(
            tmp, "polar-mitm", url, tmp / "certs", options=core.POLAR_OPTIONS
        )
        raw = args.raw or tmp / "samples.txt"
        try:
            loop = asyncio.new_event_loop()
            via = f"http://127.0.0.1:{port}"
            loop.run_until_complete(core.drive("p", core.URL, via, ctx, 4, 2, None))
            sampler = subprocess.Popen(
                [spy, "record", "-p", str(proxy.proc.pid), "-f", "raw", "-o", str(raw)]
                + ["-r", "200", "-d", str(int(args.seconds))]
                + (["--gil"] if args.gil else []),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            run = loop.run_until_complete(
                core.drive("p", core.URL, via, ctx, 32, None, args.seconds)
            )
            if sampler.wait() != 0:
                sys.exit(f"polar_bench profile: py-spy failed: {sampler.stderr.read()[-2000:]}")
            loop.close()
        finally:
            proxy.stop()
            server.stop()
        total, part = shares(raw)
    print(f"{run.ok / run.wall:.0f} calls/s while sampling; {total} main-thread samples")
    for label, fn in PARTS.items():
        print(f"{100 * part[fn]:5.1f} %  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
