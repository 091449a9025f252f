#!/usr/bin/env python
"""Flush throughput of the Store vs raw ``pyarrow.parquet.write_table`` of the same rows.

    python -m polar_bench store [--rows 4096] [--prompt-tokens 4000] [--repeat 3]

The Store does strictly more work (msgpack-encode + fsync the journal, then build the same zstd
shards, fsync + rename them, record the manifest, delete the segments), so the figure of merit is
the ratio Store / raw, goal >= 0.5. "raw" is what a script holding the same Python rows would do:
``Table.from_pylist`` + ``write_table`` (zstd), in shards of the same size as the Store's. The
prebuilt-table figure (``write_table`` alone) is printed too, for scale.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_mitm.store import CALLS_SCHEMA, Store
from polar_mitm.store.shards import Location, ShardWriter, row_group_rows

from . import core


def make_rows(n: int, prompt_tokens: int, output_tokens: int) -> list[dict]:
    rng = random.Random(0)
    t0 = 1_700_000_000_000_000
    rows = []
    for i in range(n):
        p = rng.randint(prompt_tokens // 2, prompt_tokens * 3 // 2)
        o = rng.randint(output_tokens // 2, output_tokens * 3 // 2)
        rows.append(
            {
                "call_id": f"call-{i:08d}",
                "rollout_id": f"task-{i // 16}.{i % 8}",
                "group_id": f"task-{i // 16}",
                "sample_index": i % 8,
                "started_at": t0 + i * 1000,
                "finished_at": t0 + i * 1000 + 900,
                "dialect": "openai_chat",
                "method": "POST",
                "host": "api.openai.com",
                "path": "/v1/chat/completions",
                "stream": True,
                "model_requested": "gpt-x",
                "model_served": "qwen3",
                "prompt_token_ids": [rng.randrange(151_000) for _ in range(p)],
                "output_token_ids": [rng.randrange(151_000) for _ in range(o)],
                "output_logprobs": [-rng.random() * 3 for _ in range(o)],
                "finish_reason": "stop",
                "usage_prompt_tokens": p,
                "usage_completion_tokens": o,
                "status": "completed",
                "http_status": 200,
                "fidelity_flags": [],
                "trainable": True,
                "request_json": '{"messages": ['
                + ",".join(
                    f'{{"role": "user", "content": "turn {k} of the task"}}'
                    for k in range(p // 100)
                )
                + "]}",
                "response_json": '{"choices": [{"message": {"content": "done"}}]}',
            }
        )
    return rows


def bench_raw(
    rows: list[dict], shard_rows: int, directory: str, same_options: bool
) -> tuple[float, float]:
    """from_pylist + write_table per shard; with ``same_options`` the exact writer options the
    Store uses (dictionary pages only on strings, statistics only on scalars), else pyarrow's
    defaults with zstd."""
    os.makedirs(directory, exist_ok=True)
    writer = ShardWriter(Location(pafs.LocalFileSystem(), directory, True), "bench")
    start = time.perf_counter()
    write_only = 0.0
    for k in range(0, len(rows), shard_rows):
        table = pa.Table.from_pylist(rows[k : k + shard_rows], schema=CALLS_SCHEMA)
        w0 = time.perf_counter()
        if same_options:
            options = writer._options("calls", table)
        else:
            options = {"compression": "zstd", "row_group_size": row_group_rows(table)}
        pq.write_table(table, os.path.join(directory, f"part-{k}.parquet"), **options)
        write_only += time.perf_counter() - w0
    return time.perf_counter() - start, write_only


def bench_store(rows: list[dict], shard_rows: int, directory: str) -> tuple[float, dict]:
    store = Store(directory, flush_rows=shard_rows, flush_age_s=3600)
    store.start()
    start = time.perf_counter()
    for row in rows:
        store.append("calls", row)
    ok = store.flush()
    elapsed = time.perf_counter() - start
    stats = store.stats
    store.close()
    assert ok and stats["rows_in_shards"] == len(rows), stats
    return elapsed, stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--output-tokens", type=int, default=500)
    ap.add_argument("--shard-rows", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)

    rows = make_rows(args.rows, args.prompt_tokens, args.output_tokens)
    mb = pa.Table.from_pylist(rows[:256], schema=CALLS_SCHEMA).nbytes / 256 * len(rows) / 1e6
    scratch = args.dir or tempfile.mkdtemp(prefix="polar-bench-")
    best_raw = best_write = best_same = best_store = float("inf")
    stats: dict = {}
    try:
        for r in range(args.repeat):
            raw, write_only = bench_raw(
                rows, args.shard_rows, os.path.join(scratch, f"raw{r}"), False
            )
            same, _ = bench_raw(rows, args.shard_rows, os.path.join(scratch, f"same{r}"), True)
            store, stats = bench_store(rows, args.shard_rows, os.path.join(scratch, f"store{r}"))
            best_raw, best_write = min(best_raw, raw), min(best_write, write_only)
            best_same, best_store = min(best_same, same), min(best_store, store)
            print(
                f"run {r}: raw {raw:.2f}s (write_table alone {write_only:.2f}s), "
                f"raw with the Store's options {same:.2f}s, store {store:.2f}s"
            )
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{len(rows)} rows, ~{mb:.0f} MB of Arrow data, shards of {args.shard_rows} rows "
        f"(best of {args.repeat}):"
    )

    def speed(seconds: float) -> tuple[str, str]:
        return f"{len(rows) / seconds:.0f}", f"{mb / seconds:.1f}"

    table = [
        ("raw from_pylist + write_table", *speed(best_raw)),
        ("raw write_table alone", *speed(best_write)),
        ("raw, the Store's writer options", *speed(best_same)),
        ("Store append .. flush", *speed(best_store)),
        ("ratio Store / raw (goal >= 0.5)", f"{best_raw / best_store:.2f}", ""),
        ("ratio Store / raw with the Store's options", f"{best_same / best_store:.2f}", ""),
    ]
    results = {
        "config": {
            "rows": len(rows),
            "arrow_mb": mb,
            "shard_rows": args.shard_rows,
            "repeat": args.repeat,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
        },
        "store_vs_raw": best_raw / best_store,
        "store_vs_raw_same_options": best_same / best_store,
        "journal_fsyncs": stats.get("fsyncs"),
        "shards": stats.get("shards_written"),
    }
    header = (f"{len(rows)} rows, ~{mb:.0f} MB, shards of {args.shard_rows}", "rows/s", "MB/s")
    argv = sys.argv[1:] if argv is None else argv
    core.report(results, header, lambda _: table, "store", args.json, argv)
    print(f"  journal fsyncs {stats.get('fsyncs')}, shards {stats.get('shards_written')}")


if __name__ == "__main__":
    main()
