"""What the CLI reads: the shards under a `polar_output`, checked, with a progress bar on long scans.

The store's own reader (`store.read_table`) reads every shard in one go; here each shard is read on
its own so a person watching a terminal sees progress, and only the columns a command needs are
read (a summary does not need the request/response JSON or the token lists). Errors a user can
meet (no such directory, a directory that holds no shards, unreadable shards) become `DataError`
with one line that says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.dataset as ds

from ..store import SCHEMAS, dedupe, list_shards
from ..store.delta import NEEDS, resolve
from ..store.shards import resolve_output

# Columns the summary, the calls table and the report need from calls/ (not the request/response
# JSON, not the token lists: their lengths come from pyarrow without building Python lists).
CALL_FIGURES = (
    "call_id",
    "rollout_id",
    "rollout_source",
    "group_id",
    "sample_index",
    "started_at",
    "first_byte_at",
    "finished_at",
    "dialect",
    "purpose",
    "model_requested",
    "model_served",
    "prompt_token_ids",
    "output_token_ids",
    "ids_source",
    "finish_reason",
    "status",
    "http_status",
    "error",
    "fidelity_flags",
    "fidelity_json",  # only whether a check ran ("checked") is read from it
    "trainable",
    "constrained_from",
)
# traces/ without the token arrays (num_policy_tokens / num_env_tokens carry their sums).
TRACE_FIGURES = (
    "trace_id",
    "revision",
    "rollout_id",
    "group_id",
    "sample_index",
    "role",
    "purpose",
    "agent",
    "parent_trace_id",
    "break_reason",
    "call_ids",
    "num_policy_tokens",
    "num_env_tokens",
    "fidelity_flags",
    "reward",
    "status",
    "trainable",
    "untrainable_reason",
    "created_at",
)
_KEYS = {"calls": ("call_id",), "traces": ("trace_id", "revision")}


class DataError(Exception):
    """A problem with the user's data directory, as one line (the CLI prints it and exits 1)."""


def check_output(output: str) -> None:
    """Fail early and clearly on a local path that does not exist or is not a directory."""
    if "://" in output:
        return
    if not os.path.exists(output):
        raise DataError(f"{output} does not exist (give the proxy's polar_output directory)")
    if not os.path.isdir(output):
        raise DataError(f"{output} is not a directory (give the proxy's polar_output directory)")


def shard_paths(output: str, dataset: str) -> list[str]:
    check_output(output)
    try:
        return list_shards(output, dataset)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot list the {dataset} shards under {output}: {e}") from None


def read(
    output: str,
    dataset: str,
    columns: Sequence[str] | None = None,
    *,
    progress: bool = True,
    required: bool = True,
    rollout: str | None = None,
) -> pa.Table:
    """Every shard of ``dataset`` (deduplicated like `store.read_table`), only ``columns``.

    ``required``: no shard at all is a `DataError` (else an empty table). ``progress``: a rich
    progress bar on stderr when it is a terminal and there is more than a handful of shards.
    ``rollout``: only that rollout's rows (pushed down into the Parquet scan).
    """
    paths = shard_paths(output, dataset)
    schema = SCHEMAS[dataset]
    if columns is not None:
        wanted = list(dict.fromkeys([*_KEYS[dataset], *columns, *_needs(dataset, columns)]))
        schema = pa.schema([schema.field(c) for c in wanted])
    if not paths:
        if required:
            where = os.path.join(output, dataset) if "://" not in output else f"{output}/{dataset}"
            raise DataError(
                f"no {dataset} shards under {where} (is {output} the proxy's polar_output, "
                "and has the proxy flushed or stopped?)"
            )
        return schema.empty_table()
    fs = resolve_output(output).fs
    where_rollout = ds.field("rollout_id") == rollout if rollout is not None else None
    tables = []
    try:
        for path in _progress(paths, f"reading {dataset}", progress):
            shard = ds.dataset([path], schema=schema, format="parquet", filesystem=fs)
            tables.append(shard.to_table(filter=where_rollout))
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"cannot read the {dataset} shards under {output}: {e}") from None
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    table = dedupe(dataset, table)
    if dataset != "calls":
        return table
    table = resolve(table)
    extra = [c for c in _needs(dataset, columns or ()) if columns is not None and c not in columns]
    return table.drop_columns(extra) if extra else table


def _needs(dataset: str, columns: Sequence[str]) -> list[str]:
    """The columns a calls read needs to give prompt ids and requests back whole (store/delta.py:
    they may be stored as what they add to an earlier call)."""
    if dataset != "calls":
        return []
    return list(dict.fromkeys(n for c in columns for n in NEEDS.get(c, ())))


def _progress(items: Sequence[str], what: str, enabled: bool) -> Iterable[str]:
    """``items``, with a transient progress bar on a terminal (stderr) for long scans."""
    if not enabled or len(items) < 8:
        return items
    from rich.console import Console
    from rich.progress import track

    console = Console(stderr=True)
    if not console.is_terminal:
        return items
    return track(items, description=what, console=console, transient=True)
