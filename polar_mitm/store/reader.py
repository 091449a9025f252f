"""Reading the datasets back: every shard, with the duplicates a crash can leave removed.

Shards are immutable and a row can occur in two of them (a crash between writing a shard and
recording it in the manifest, or a retried multi-day flush), and a trace is rewritten with a higher
``revision`` when its reward arrives. So readers dedupe: one row per ``call_id``; per ``trace_id``
the highest revision. Rows keep the order of the shards (by name: time, then proxy).
"""

from __future__ import annotations

import os
import posixpath

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from .delta import resolve
from .schema import SCHEMAS
from .shards import Location, resolve_output


def _check(dataset: str) -> None:
    if dataset not in SCHEMAS:
        raise ValueError(f"unknown dataset {dataset!r} (expected one of {', '.join(SCHEMAS)})")


def _list(location: Location, dataset: str) -> list[str]:
    selector = pafs.FileSelector(
        location.dataset_dir(dataset), recursive=True, allow_not_found=True
    )
    paths = [
        info.path
        for info in location.fs.get_file_info(selector)
        if info.type == pafs.FileType.File
        and posixpath.basename(info.path).startswith("part-")
        and info.path.endswith(".parquet")
    ]
    return sorted(paths, key=lambda p: (posixpath.basename(p), p))


def list_shards(
    output: str | os.PathLike[str], dataset: str, filesystem: pafs.FileSystem | None = None
) -> list[str]:
    """Paths of the dataset's committed shards (never temp files), oldest first."""
    _check(dataset)
    return _list(resolve_output(output, filesystem), dataset)


def dedupe(dataset: str, table: pa.Table) -> pa.Table:
    """Keep one row per call_id (the last written) / per trace_id (the highest revision, then the
    last written), preserving the order of the kept rows."""
    _check(dataset)
    if table.num_rows == 0:
        return table
    key = "call_id" if dataset == "calls" else "trace_id"
    idx = pa.array(range(table.num_rows), pa.int64())
    work = pa.table({"k": table.column(key), "i": idx})
    sort = [("k", "ascending")]
    if dataset == "traces":
        work = work.append_column("r", pc.fill_null(table.column("revision"), -1))
        sort.append(("r", "descending"))
    sort.append(("i", "descending"))
    work = work.sort_by(sort)
    keys = work.column("k").combine_chunks()
    if len(keys) > 1:
        changed = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
        # null keys cannot happen (required columns); treat them as distinct anyway
        changed = pc.fill_null(changed, True)
        first = pa.concat_arrays([pa.array([True]), changed])
    else:
        first = pa.array([True])
    kept = pc.sort_indices(pc.filter(work.column("i"), first))
    keep = pc.take(pc.filter(work.column("i"), first), kept)
    return table.take(keep)


def read_table(
    output: str | os.PathLike[str],
    dataset: str,
    filesystem: pafs.FileSystem | None = None,
    dedup: bool = True,
) -> pa.Table:
    """All shards of ``calls`` or ``traces`` as one table of the current schema.

    Shards written under an older schema read fine: the current schema is imposed, and columns they
    lack come back as nulls. Calls come back with their full prompt ids and requests (`delta.resolve`). The ``date`` partition is not a column here (it is derived from the
    row's own timestamps); ``pyarrow.dataset.dataset(<output>/<dataset>, partitioning="hive")``
    gives it to those who want it.
    """
    _check(dataset)
    location = resolve_output(output, filesystem)
    paths = _list(location, dataset)
    schema = SCHEMAS[dataset]
    if not paths:
        return schema.empty_table()
    table = ds.dataset(paths, schema=schema, format="parquet", filesystem=location.fs).to_table()
    table = dedupe(dataset, table) if dedup else table
    return resolve(table) if dataset == "calls" else table
