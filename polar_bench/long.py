"""The long-session load (`python -m polar_bench long`): agent sessions as a farm runs them.

A real harness call is nothing like a short chat: Claude Code's first request is ~11.5k tokens,
Codex's 15-30k (tests/fixtures/harness/), and every later call re-sends the whole growing
conversation with its tool results. So each session here has a 40k-character system prompt, 10
tools with long descriptions and one tool call per turn answered by a 6k-character tool result,
and re-sends everything each turn (the reference server plays the scripted reply; the client
appends it, as the harness would, with its reasoning, so the trajectory merge sees one chain).

Columns: direct (the yardstick for added latency), mitm-stream, capture-floor, polar-mitm,
polar-mitm@half (the same proxy and sessions stopped at half the turns: its bytes per token is the
figure the linear-storage goal compares against) and polar-mitm+exact (`polar_exact_prefix=true`
with the Qwen3 tokenizer: every call after a session's first goes to the server's token-in
endpoint as the chain's ids plus the new messages) and polar-mitm+exact+buffer (the same with
`polar_upstream_stream=buffer`: the server is asked for whole replies, and the proxy streams
each to the harness when complete). Every turn, the columns take turns (rotating
order), all sessions of a column at once, so drift on a shared machine moves every column alike.
Figures: proxy CPU per call (all of a proxy's CPU from its first call to a settle after its last,
over its calls), latency p50 of the first and last fifth of the turns (to the last byte, and to
the first for the last fifth), peak RSS (VmHWM), polar-mitm's
bytes on disk (the output folder after a clean stop) per token of the final conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from . import core

LONG_COLUMNS = (
    "direct",
    "mitm-stream",
    "capture-floor",
    "polar-mitm",
    "polar-mitm@half",
    "polar-mitm+exact",
    "polar-mitm+exact+buffer",
)
# The long sessions' rollouts stay open for the whole run (a turn waits for the other columns)
# and end as a farm ends them: its reward posted to the control plane (`end_rollouts`).
LONG_OPTIONS = {"polar_rollout_idle": "0", "polar_control_token": "bench-long-control"}
SYSTEM_CHARS, TOOL_RESULT_CHARS, TOOLS = 40_000, 6_000, 10
WORDS = [
    "the",
    "file",
    "function",
    "returns",
    "value",
    "error",
    "test",
    "module",
    "import",
    "class",
    "self",
    "data",
    "path",
    "config",
    "request",
    "response",
    "token",
    "stream",
    "buffer",
    "index",
    "list",
    "dict",
    "string",
    "number",
    "result",
    "check",
    "build",
    "run",
    "shell",
    "command",
    "output",
    "line",
    "print",
    "open",
    "read",
    "write",
    "close",
    "parse",
    "json",
    "yaml",
    "http",
    "server",
    "client",
    "proxy",
    "cache",
    "store",
    "record",
    "call",
    "session",
    "rollout",
    "trace",
    "merge",
    "chain",
    "prefix",
    "suffix",
]


def text(rng: random.Random, chars: int, code: bool = False) -> str:
    """Prose or code-like text of about `chars` characters (about 4 characters a token with the
    Qwen3 tokenizer, like the recorded harness requests)."""
    out: list[str] = []
    size = 0
    while size < chars:
        if code:
            name, attr = rng.choice(WORDS), rng.choice(WORDS)
            line = f"    {name}_{rng.randrange(100)} = {attr}.{rng.choice(WORDS)}({rng.randrange(1000)})"
        else:
            line = " ".join(rng.choice(WORDS) for _ in range(12)) + "."
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:chars]


def tools(rng: random.Random) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": text(rng, 1500),
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string", "description": text(rng, 200)}},
                    "required": ["cmd"],
                },
            },
        }
        for i in range(TOOLS)
    ]


def reply(turn: int) -> tuple[str, str, dict[str, str]]:
    """The scripted reply of a turn: reasoning, content and the tool call's arguments."""
    return (
        f"Step {turn}: read the next file.",
        f"Looking at module {turn}.",
        {"cmd": f"cat src/module_{turn}.py"},
    )


def column_options(column: str) -> dict[str, str]:
    """A polar-mitm column's --sets: exact-prefix mode renders new messages with the Qwen3
    tokenizer and chat template the reference server uses; `+buffer` asks the server for whole
    replies (polar_upstream_stream=buffer)."""
    buffer = {"polar_upstream_stream": "buffer"} if column.endswith("+buffer") else {}
    if not column.startswith("polar-mitm+exact"):
        return {**LONG_OPTIONS, **buffer}
    from polar_mitm.assets import qwen3_tokenizer_dir

    return {
        **LONG_OPTIONS,
        "polar_exact_prefix": "true",
        "polar_tokenizer": str(qwen3_tokenizer_dir()),
        **buffer,
    }


def write_scenario(tmp: Path, turns: int) -> Path:
    script = [
        {
            "reasoning": r,
            "content": c,
            "tool_calls": [{"name": f"tool_{t % TOOLS}", "arguments": a}],
        }
        for t, (r, c, a) in ((t, reply(t)) for t in range(turns))
    ]
    path = tmp / "long.json"
    path.write_text(json.dumps({"model": "Qwen/Qwen3-4B", "scripts": [{"turns": script}]}))
    return path


class Session:
    """One agent session's conversation, re-sent whole each turn (the same for every column)."""

    def __init__(self, index: int) -> None:
        rng = random.Random(index)
        self.rng = rng
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": text(rng, SYSTEM_CHARS)},
            {"role": "user", "content": f"Session {index}: fix the failing tests in src/."},
        ]
        self.tools = tools(rng)

    def body(self) -> dict[str, Any]:
        return {
            "model": "Qwen/Qwen3-4B",
            "stream": True,
            "messages": self.messages,
            "tools": self.tools,
        }

    def advance(self, turn: int) -> None:
        reasoning, content, arguments = reply(turn)
        self.messages = [
            *self.messages,
            {
                "role": "assistant",
                "content": content,
                "reasoning_content": reasoning,
                "tool_calls": [
                    {
                        "id": f"call_{turn}",
                        "type": "function",
                        "function": {
                            "name": f"tool_{turn % TOOLS}",
                            "arguments": json.dumps(arguments),
                        },
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": f"call_{turn}",
                "content": text(self.rng, TOOL_RESULT_CHARS, code=True),
            },
        ]


async def end_rollouts(proxy: str, rollouts: list[str]) -> None:
    """Post each rollout's reward (its end: the proxy writes its trace), as a farm does, through
    the proxy's control plane; that work counts in the proxy's CPU."""
    auth = {"authorization": f"Bearer {LONG_OPTIONS['polar_control_token']}"}
    async with aiohttp.ClientSession() as s:
        for rollout in rollouts:
            url = f"http://polar.control/v1/rollouts/{rollout}/end"
            async with s.post(url, json={"reward": 1.0}, proxy=proxy, headers=auth) as r:
                if r.status != 200:
                    raise RuntimeError(f"ending {url}: {r.status} {await r.text()}")


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def conversation_tokens(folder: Path, prefix: str = "long-") -> int:
    """Tokens of the final conversations: per rollout (those named `prefix`...), its longest
    prompt plus that call's output."""
    from polar_mitm.store import read_table

    calls = read_table(folder, "calls").to_pylist()
    best: dict[str, int] = {}
    for c in calls:
        if not c["rollout_id"].startswith(prefix):
            continue
        n = len(c["prompt_token_ids"] or ()) + len(c["output_token_ids"] or ())
        best[c["rollout_id"]] = max(best.get(c["rollout_id"], 0), n)
    return sum(best.values())


def token_in_calls(folder: Path) -> int:
    """The calls of the long sessions sent to the token-in endpoint (exact-prefix mode)."""
    from polar_mitm.store import read_table

    calls = read_table(folder, "calls").select(["rollout_id", "route"]).to_pylist()
    return sum(c["route"] == "token_in" for c in calls if c["rollout_id"].startswith("long-"))


def storage(folder: Path) -> dict[str, Any]:
    """What the stored data holds: traces per rollout (1: the merge saw one conversation) and
    the compressed bytes of each calls column (where the disk goes)."""
    import pyarrow.parquet as pq

    from polar_mitm.store import list_shards, read_table

    traces = read_table(folder, "traces")
    columns: dict[str, int] = {}
    with_base = 0  # calls stored as what they add to an earlier one (since schema 2)
    for path in list_shards(folder, "calls"):
        base = pq.read_table(path, columns=["base_call_id"]).column(0)
        with_base += len(base) - base.null_count
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                chunk = group.column(c)
                name = chunk.path_in_schema.split(".")[0]
                columns[name] = columns.get(name, 0) + chunk.total_compressed_size
    rollouts = {r for r in traces.column("rollout_id").to_pylist() if not r.startswith("warm-")}
    whole = read_table(folder, "calls")  # every prompt and request whole, as schema 1 stored them
    alternatives = {
        name: parquet_bytes(whole, folder / f"alt-{i}.parquet", **opts)
        for i, (name, opts) in enumerate(PARQUET_ALTERNATIVES.items())
    }
    return {
        "traces_per_rollout": sum(
            1 for r in traces.column("rollout_id").to_pylist() if r in rollouts
        )
        / max(len(rollouts), 1),
        "calls_column_bytes": dict(sorted(columns.items(), key=lambda kv: -kv[1])[:6]),
        "calls_bytes": sum(columns.values()),
        "calls_with_base": with_base,
        "calls_bytes_whole_rows": alternatives,
    }


# The alternative to storing deltas: whole rows, and Parquet settings that might dedupe them. All
# in one file of every call (the best case: a proxy's shards split a rollout's calls), sorted by
# rollout then time so that a call sits next to the one it extends; one page per column chunk so
# that zstd's window spans more than one value.
PARQUET_ALTERNATIVES: dict[str, dict[str, Any]] = {
    "zstd (the store's settings)": {},
    "zstd-19, sorted, 1 GiB pages": {
        "sort": True,
        "compression_level": 19,
        "data_page_size": 1 << 30,
    },
}


def parquet_bytes(table: Any, path: Path, sort: bool = False, **opts: Any) -> int:
    import pyarrow.parquet as pq

    if sort:
        table = table.sort_by([("rollout_id", "ascending"), ("started_at", "ascending")])
    pq.write_table(table, path, compression="zstd", **opts)
    size = path.stat().st_size
    path.unlink()
    return size


def peak_rss_mb(child: core.Child) -> float:
    for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run_load(
    ts: dict[str, core.Target], sessions: int, turns: int
) -> tuple[dict[str, list[list[core.Sample]]], dict[str, float], dict[str, tuple[float, float]]]:
    """Every turn: each column in turn (rotating order) makes that turn's call of every session
    at once. Returns the samples per column per turn, each proxy's CPU seconds, and each
    column's first call after start and the median of the three after it (seconds, a short chat
    on a new connection each)."""
    convs = [Session(i) for i in range(sessions)]
    pools = core.session_pools(ts, sessions, total=300)
    samples: dict[str, list[list[core.Sample]]] = {c: [] for c in ts}
    order = list(ts)
    first: dict[str, tuple[float, float]] = {}
    try:
        for column, t in ts.items():  # the first call after start, then warm ones: each on
            one = []  # a connection of its own (a new harness: CONNECT and TLS handshake too)
            for k in range(4):
                async with aiohttp.ClientSession() as fresh:
                    call = await core.one_call(fresh, t.url, t.proxy, t.ssl, f"first-{column}.{k}")
                one.append(call.ttlb)
            first[column] = (one[0], statistics.median(one[1:]))
        for column, t in ts.items():  # warm up (TLS, certificates) on rollouts of their own
            await asyncio.gather(
                *(
                    core.one_call(s, t.url, t.proxy, t.ssl, f"warm-{column}.{i}")
                    for i, s in enumerate(pools[column])
                )
            )
        cpu0 = {c: t.child.cpu_seconds() for c, t in ts.items() if t.child is not None}
        for turn in range(turns):
            bodies = [s.body() for s in convs]
            # The server caches its render of a request (chat template + tokenizer, under a lock:
            # about a second for a few 30k-token prompts on 2 busy cores): one unmeasured direct
            # call per session first, so no column pays it for the others.
            prime = ts["direct"]
            await asyncio.gather(
                *(
                    core.one_call(s, prime.url, None, False, f"prime.{i}", bodies[i])
                    for i, s in enumerate(pools["direct"])
                )
            )
            for column in order[turn % len(order) :] + order[: turn % len(order)]:
                if column == "polar-mitm@half" and turn >= turns // 2:
                    continue
                t = ts[column]
                got = await asyncio.gather(
                    *(
                        core.one_call(s, t.url, t.proxy, t.ssl, f"long-{column}.{i}", bodies[i])
                        for i, s in enumerate(pools[column])
                    )
                )
                samples[column].append(list(got))
            for s in convs:
                s.advance(turn)
            core.progress(f"long sessions: turn {turn + 1}/{turns}")
    finally:
        await core.close_pools(pools)
    for column, t in ts.items():
        if column.startswith("polar-mitm"):
            await end_rollouts(t.proxy, [f"long-{column}.{i}" for i in range(sessions)])
    await asyncio.sleep(core.SETTLE_S)
    cpu = {c: ts[c].child.cpu_seconds() - v for c, v in cpu0.items()}
    return samples, cpu, first


def p50(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def measure_long(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start the columns, run the load, stop them; the figures per column."""
    from polar_mitm.certs import ensure_ca

    confdir = tmp / "certs"
    ssl_ctx = ssl.create_default_context(cafile=str(ensure_ca(confdir)))
    server = core.spawn_server(tmp, write_scenario(tmp, args.long_turns), 0, "server-long")
    upstream = core.server_url(server)
    ts: dict[str, core.Target] = {
        "direct": core.Target(upstream + "/v1/chat/completions", None, False)
    }
    data: dict[str, Path] = {}
    try:
        for column in LONG_COLUMNS[1:]:
            kind = "polar-mitm" if column.startswith("polar-mitm") else column
            name = "long-" + re.sub(r"[^\w.-]", "-", column)
            child, port = core.start_proxy(
                tmp, kind, upstream, confdir, name, column_options(column), wait=False
            )
            ts[column] = core.Target(core.URL, f"http://127.0.0.1:{port}", ssl_ctx, child)
            if kind == "polar-mitm":
                data[column] = tmp / f"{name}-data"
        for t in ts.values():
            if t.child is not None:
                t.child.wait_ready()
        t0 = time.perf_counter()
        samples, cpu, first = asyncio.run(run_load(ts, args.long_sessions, args.long_turns))
        wall = time.perf_counter() - t0
        rss = {c: peak_rss_mb(t.child) for c, t in ts.items() if t.child is not None}
    finally:
        core.stop_targets(ts)
        server.stop()
    out: dict[str, Any] = {
        "config": {"sessions": args.long_sessions, "turns": args.long_turns, "wall_s": wall},
        "columns": {},
    }
    fifth = max(args.long_turns // 5, 1)
    for column, per_turn in samples.items():
        flat = [s for turn in per_turn for s in turn]
        ok = [s for s in flat if s.ok]
        col: dict[str, Any] = {
            "calls": len(ok),
            "errors": len(flat) - len(ok),
            "early_ms_p50": 1000 * p50([s.ttlb for t in per_turn[:fifth] for s in t if s.ok]),
            "late_ms_p50": 1000 * p50([s.ttlb for t in per_turn[-fifth:] for s in t if s.ok]),
            "late_ttfb_ms_p50": 1000 * p50([s.ttfb for t in per_turn[-fifth:] for s in t if s.ok]),
            "first_call_ms": 1000 * first[column][0],
            "warm_call_ms": 1000 * first[column][1],
            "ttlb_ms_by_turn": [1000 * p50([s.ttlb for s in t if s.ok]) for t in per_turn],
        }
        if column in cpu:
            col["cpu_ms_per_call"] = 1000 * cpu[column] / max(len(ok), 1)
            col["peak_rss_mb"] = rss[column]
        if column in data:
            tokens = conversation_tokens(data[column])
            col["disk_bytes"] = disk_bytes(data[column])
            col["tokens"] = tokens
            col["bytes_per_token"] = col["disk_bytes"] / tokens if tokens else float("nan")
            col.update(storage(data[column]))
            col["token_in_calls"] = token_in_calls(data[column])
        out["columns"][column] = col
    return out


HEADER = ("figure", "polar-mitm", "mitm-stream", "capture-floor", "ratio (to stream; to floor)")


def report_long(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Rows: figure, polar-mitm, mitm-stream, capture-floor, ratio (to mitm-stream; to floor)."""
    cols = results["columns"]
    polar, stream, floor = cols["polar-mitm"], cols["mitm-stream"], cols["capture-floor"]
    direct = cols["direct"]

    def row(name: str, key: str, unit: str, fmt: str = "{:.1f}") -> tuple[str, ...]:
        p, s, f = polar[key], stream[key], floor[key]
        return (
            name,
            fmt.format(p) + unit,
            fmt.format(s),
            fmt.format(f),
            f"{p / s:.2f}; {p / f:.2f}",
        )

    rows = [
        row("proxy CPU per call", "cpu_ms_per_call", " ms"),
        row("latency p50, first fifth of the turns", "early_ms_p50", " ms", "{:.0f}"),
        row("latency p50, last fifth of the turns", "late_ms_p50", " ms", "{:.0f}"),
        row("peak RSS", "peak_rss_mb", " MB", "{:.0f}"),
    ]
    rows.append(
        (
            "first call after start / a warm one (new connections)",
            f"{polar['first_call_ms']:.0f} / {polar['warm_call_ms']:.0f} ms",
            f"{stream['first_call_ms']:.0f} / {stream['warm_call_ms']:.0f}",
            f"{floor['first_call_ms']:.0f} / {floor['warm_call_ms']:.0f}",
            f"{polar['first_call_ms'] / polar['warm_call_ms']:.2f} (polar-mitm's own ratio)",
        )
    )
    for when in ("early", "late"):
        key = f"{when}_ms_p50"
        p, s, f = (c[key] - direct[key] for c in (polar, stream, floor))
        rows.append(
            (
                f"added latency p50 over direct, {when}",
                f"{p:.0f} ms",
                f"{s:.0f}",
                f"{f:.0f}",
                f"{p / s:.2f}; {p / f:.2f}" if s > 0 and f > 0 else "",
            )
        )
    for column, mode in (
        ("polar-mitm+exact", "exact-prefix"),
        ("polar-mitm+exact+buffer", "exact-prefix, buffered"),
    ):
        exact = cols.get(column)
        if exact is None:  # a run saved before the column existed
            continue
        # token-in: its goals are against mitm-stream, and RSS chat mode's
        figures = [
            ("proxy CPU per call", "cpu_ms_per_call", " ms"),
            ("latency p50, last fifth of the turns", "late_ms_p50", " ms"),
            ("peak RSS", "peak_rss_mb", " MB"),
        ]
        if "late_ttfb_ms_p50" in exact:
            figures.insert(
                2, ("first byte p50, last fifth of the turns", "late_ttfb_ms_p50", " ms")
            )
        for name, key, unit in figures:
            e, s, f, p = exact[key], stream[key], floor[key], polar[key]
            rows.append(
                (
                    f"{mode}: {name} (chat mode {p:.1f})",
                    f"{e:.1f}{unit}",
                    f"{s:.1f}",
                    f"{f:.1f}",
                    f"{e / s:.2f}; {e / f:.2f}; x chat mode {e / p:.2f}",
                )
            )
    half = cols.get("polar-mitm@half", {})
    rows.append(
        (
            "bytes on disk per token of the final conversations",
            f"{polar['bytes_per_token']:.2f}",
            "",
            "",
            f"{polar['bytes_per_token'] / half['bytes_per_token']:.2f} (x the figure at "
            f"half the turns, {half['bytes_per_token']:.2f})"
            if half.get("bytes_per_token")
            else "",
        )
    )
    if "open_rollouts" in results:
        o = results["open_rollouts"]
        rows.append(
            (
                f"RSS per unique token, {o['rollouts']} open rollouts x {o['turns']} turns",
                f"{o['bytes_per_token']:.1f} B",
                "",
                "",
                f"{o['rss_before_mb']:.0f} -> {o['rss_after_mb']:.0f} MB over "
                f"{o['unique_tokens']:,} tokens",
            )
        )
    alt = polar.get("calls_bytes_whole_rows") or {}
    if alt:
        rows.append(
            (
                "calls table MB: as stored / whole rows (" + " | ".join(alt) + ")",
                f"{polar['calls_bytes'] / 1e6:.2f}",
                "",
                "",
                " | ".join(f"{v / 1e6:.2f}" for v in alt.values()),
            )
        )
    return rows


def measure_open_rollouts(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """RSS per unique token held by open rollouts: `args.open_rollouts` sessions of
    `args.open_turns` turns each through one polar-mitm, none ended; the proxy's RSS after a
    warm-up of as many short rollouts (ended: what every proxy holds anyway) and after the load,
    over the tokens of the open rollouts' conversations (their final prompt and output)."""
    from polar_mitm.certs import ensure_ca

    confdir = tmp / "certs"
    ssl_ctx = ssl.create_default_context(cafile=str(ensure_ca(confdir)))
    server = core.spawn_server(tmp, write_scenario(tmp, args.open_turns), 0, "server-open")
    upstream = core.server_url(server)
    # shards every second: the figure is what open rollouts hold, not the store's unflushed rows
    options = {**LONG_OPTIONS, "polar_flush_seconds": "1"}
    child, port = core.start_proxy(tmp, "polar-mitm", upstream, confdir, "open-polar-mitm", options)
    target = core.Target(core.URL, f"http://127.0.0.1:{port}", ssl_ctx, child)
    n = args.open_rollouts

    async def load() -> tuple[float, float]:
        convs = [Session(i) for i in range(n)]
        limit = asyncio.Semaphore(32)  # a farm's proxy sees many open rollouts, few calls at once
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

            async def call(key: str, body: dict[str, Any] | None) -> None:
                async with limit:
                    r = await core.one_call(s, target.url, target.proxy, target.ssl, key, body)
                    if not r.ok:
                        raise RuntimeError(f"a call of {key} failed")

            await asyncio.gather(*(call(f"warm-open.{i}", None) for i in range(n)))
            await end_rollouts(target.proxy, [f"warm-open.{i}" for i in range(n)])
            await asyncio.sleep(2 * core.SETTLE_S)
            before = child.rss_mb()
            for turn in range(args.open_turns):
                await asyncio.gather(*(call(f"open.{i}", c.body()) for i, c in enumerate(convs)))
                for c in convs:
                    c.advance(turn)
                core.progress(f"open rollouts: turn {turn + 1}/{args.open_turns}")
            await asyncio.sleep(2 * core.SETTLE_S)
            return before, child.rss_mb()

    try:
        before, after = asyncio.run(load())
        peak = peak_rss_mb(child)
    finally:
        child.stop()
        server.stop()
    tokens = conversation_tokens(tmp / "open-polar-mitm-data", prefix="open.")
    return {
        "rollouts": n,
        "turns": args.open_turns,
        "rss_before_mb": before,
        "rss_after_mb": after,
        "peak_rss_mb": peak,
        "unique_tokens": tokens,
        "bytes_per_token": (after - before) * 2**20 / tokens if tokens else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m polar_bench long`: the long-session load, the open rollouts, their table; --json
    saves the figures. The same sessions against the real vLLM are their own scenarios (vllm.py,
    farm.py), which import this module: it imports neither."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4 sessions x 12 turns, 64 open rollouts")
    ap.add_argument("--smoke", action="store_true", help="2 x 4, 8 open rollouts: that it runs")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 8)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (default 30)")
    args = ap.parse_args(argv)
    small = (2, 4) if args.smoke else (4, 12) if args.quick else (8, 30)
    args.long_sessions = args.sessions or small[0]
    args.long_turns = args.turns or small[1]
    args.open_rollouts = 8 if args.smoke else 64 if args.quick else 256
    args.open_turns = 1 if args.smoke or args.quick else 2
    with tempfile.TemporaryDirectory(prefix="polar-bench-long-") as d:
        results = measure_long(args, Path(d))
    with tempfile.TemporaryDirectory(prefix="polar-bench-open-") as d:
        results["open_rollouts"] = measure_open_rollouts(args, Path(d))
    argv = sys.argv[1:] if argv is None else argv
    core.report(results, HEADER, report_long, "long", args.json, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
