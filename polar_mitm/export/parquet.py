"""Flat Parquet: one row per trace, its latest revision, in one file any Parquet reader takes.

The raw `traces/` folder keeps every revision of a trace (a reward joined later is a new row with
a higher `revision`; no shard is ever rewritten, so a crash cannot lose a trace and several
writers never contend for a file). polar-mitm's readers keep the highest revision, but a reader
that only sees Parquet, `datasets.load_dataset("parquet", ...)`, Ray Data's `read_parquet`, DuckDB's
`read_parquet`, gets every revision: after two reward joins a trace is three rows. This export is
the view to hand such readers: the trace rows as polar-mitm reads them (`captured.read` keeps the
latest revision), under the schema's own column names and types (store/schema.py), plus
`prompt_length` (the first call's prompt, trainers' "prompt") and, with a tokenizer, `prompt`
and `response` text. zstd, like the shards.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ..store.schema import TRACES_SCHEMA
from .base import ExportFormat, ExportOptions, Record, decode

SCHEMA = (
    TRACES_SCHEMA.append(pa.field("prompt_length", pa.int32()))
    .append(pa.field("prompt", pa.string()))
    .append(pa.field("response", pa.string()))
)


def row(record: Record, options: ExportOptions) -> dict:
    out = {name: record.trace.get(name) for name in TRACES_SCHEMA.names}
    out["prompt_length"] = record.prompt_length
    ids = record.trace["input_ids"]
    if options.tokenizer is not None:  # else null: no text is better than a wrong one
        out["prompt"] = decode(options, ids[: record.prompt_length])
        out["response"] = decode(options, ids[record.prompt_length :])
    return out


def write(records: list[Record], path: str, options: ExportOptions) -> None:
    table = pa.Table.from_pylist([row(r, options) for r in records], schema=SCHEMA)
    pq.write_table(table, path, compression="zstd")


FORMAT = ExportFormat(
    name="parquet",
    suffix=".parquet",
    summary="one row per trace, its latest revision and reward (datasets, Ray, DuckDB read it as is)",
    write=write,
)
