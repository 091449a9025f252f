"""Parquet shards: turning journaled rows into immutable, self-describing files.

Layout: ``<output>/<dataset>/date=YYYY-MM-DD/part-<utc ts>-<proxy_id>-<segment n:08d>.parquet``, a
Hive-style partition so ``pyarrow.dataset.dataset(path, partitioning="hive")``, DuckDB, Spark, HF
``datasets`` and Ray all prune by day. The day is the row's own time (calls: ``started_at``, else
``finished_at``; traces: ``created_at``), UTC, falling back to the time of writing; one flush can
therefore produce one file per day it spans. ``<segment n>`` is the newest journal segment whose rows
the file holds; with the proxy id and a microsecond timestamp it makes names unique across proxies
sharing one bucket.

A reader never sees a partial file:
- local output: written to ``.part-….parquet.tmp`` in the same directory (hidden, so dataset
  discovery skips it), fsynced, renamed, and the directory fsynced;
- remote output (S3, GCS, …): the whole file is built in memory and sent with one
  ``open_output_stream`` to the final key. Object stores make an object visible only when its upload
  completes (PutObject, or CompleteMultipartUpload on close), so no temp key and no copy are needed;
  pyarrow has no atomic rename on S3 anyway. With delayed open (`remote.s3_filesystem`) a shard below
  the multipart part size is a single PutObject. A failed upload leaves no object (a failed big one
  at most an incomplete multipart upload, which a bucket lifecycle rule
  ``AbortIncompleteMultipartUpload`` reclaims); we also delete the key best-effort before retrying.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import posixpath
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .. import __version__
from .files import fsync_dir, replace_whole
from .journal import TYPED_COLUMNS
from .remote import display_uri, s3_filesystem
from .schema import SCHEMA_VERSION, SCHEMAS

log = logging.getLogger(__name__)

PRODUCER = f"polar-mitm {__version__}"

# Row groups are the unit a training reader decodes at once (HF datasets streaming, Ray read tasks,
# a DataLoader worker reading with iter_batches) and the unit of coarse shuffling. Our rows are big
# (a trace is input_ids + loss_mask + logprobs of up to ~100k tokens, a call carries JSON bodies), so
# the cap is in bytes: ~32 MiB of uncompressed Arrow data per group keeps a reader's working set and
# its first-batch latency small and gives a shuffle buffer many groups to mix, while the per-group
# footer/page overhead stays far below 0.1%. The row cap keeps groups of tiny rows seekable.
ROW_GROUP_TARGET_BYTES = 32 << 20
ROW_GROUP_MAX_ROWS = 8192

# The columns a row's day is taken from, first non-null wins.
PARTITION_COLUMNS: dict[str, tuple[str, ...]] = {
    "calls": ("started_at", "finished_at"),
    "traces": ("created_at",),
}

OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})

TMP_SUFFIX = ".tmp"
# Temp files of another proxy sharing the output are left alone unless this old: a crashed proxy that
# never comes back would otherwise leave them forever.
STALE_TMP_S = 3600.0


@dataclass(frozen=True)
class Location:
    """Where shards go: a pyarrow filesystem, the root path inside it, and whether it is local
    (local output gets fsync + rename; remote output gets a single atomic upload)."""

    fs: pafs.FileSystem
    root: str
    local: bool

    def dataset_dir(self, dataset: str) -> str:
        return (
            posixpath.join(self.root, dataset)
            if not self.local
            else os.path.join(self.root, dataset)
        )


def resolve_output(
    output: str | os.PathLike[str], filesystem: pafs.FileSystem | None = None
) -> Location:
    """Turn ``polar_output`` (a path, ``file://`` or any pyarrow URI such as
    ``s3://bucket/prefix?endpoint_override=…``) into a Location."""
    text = os.fspath(output)
    if filesystem is not None:
        local = isinstance(filesystem, pafs.LocalFileSystem)
        root = os.path.abspath(text) if local else text.rstrip("/")
        return Location(filesystem, root, local)
    if "://" not in text:
        return Location(pafs.LocalFileSystem(), os.path.abspath(text), True)
    if text.lower().startswith("s3://"):
        fs, root = s3_filesystem(text)  # retries, timeouts, no credentials: see remote.py
        return Location(fs, root, False)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except Exception as exc:
        raise ValueError(
            f"{display_uri(text)} is not a path or a pyarrow filesystem URI: {type(exc).__name__}"
        ) from None
    local = isinstance(fs, pafs.LocalFileSystem)
    return Location(fs, os.path.abspath(path) if local else path.rstrip("/"), local)


_CONVERT_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)

# Per dataset: the schema without the raw-array columns; from_pylist reads only these keys.
_SCALAR_SCHEMAS = {
    name: pa.schema([f for f in schema if f.name not in TYPED_COLUMNS[name]])
    for name, schema in SCHEMAS.items()
}


class _TooManyValues(Exception):
    """More values than a list column's int32 offsets can address: split the rows."""


def _list_column(values: list[Any], list_type: pa.DataType, typecode: str) -> pa.Array:
    """A list column from per-row `array.array`s by concatenating their buffers (no Python int
    is touched); other values (plain lists from an older journal, wrong types) go through
    ``pa.array`` and fail there with a precise message."""
    if not all(v is None or (isinstance(v, array) and v.typecode == typecode) for v in values):
        return pa.array([v.tolist() if isinstance(v, array) else v for v in values], type=list_type)
    offsets = array("i", [0])
    try:
        offsets.extend(accumulate(0 if v is None else len(v) for v in values))
    except OverflowError:
        raise _TooManyValues from None
    # arrays and Arrow buffers are both in native byte order (only the journal bytes are fixed LE)
    data = b"".join([memoryview(v) for v in values if v])
    child = pa.Array.from_buffers(list_type.value_type, offsets[-1], [None, pa.py_buffer(data)])
    offsets_array = pa.Array.from_buffers(
        pa.int32(), len(values) + 1, [None, pa.py_buffer(offsets)]
    )
    mask = pa.array([v is None for v in values]) if None in values else None
    return pa.ListArray.from_arrays(offsets_array, child, type=list_type, mask=mask)


def _build(dataset: str, rows: list[dict[str, Any]]) -> pa.Table:
    schema = SCHEMAS[dataset]
    typed = TYPED_COLUMNS[dataset]
    base = pa.Table.from_pylist(rows, schema=_SCALAR_SCHEMAS[dataset])
    columns = [
        _list_column([r.get(f.name) for r in rows], f.type, typed[f.name])
        if f.name in typed
        else base.column(f.name)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _build_split(dataset: str, rows: list[dict[str, Any]]) -> pa.Table:
    try:
        return _build(dataset, rows)
    except _TooManyValues:
        if len(rows) == 1:
            raise ValueError("a list column has more than 2**31-1 values") from None
        half = len(rows) // 2
        return pa.concat_tables(
            [_build_split(dataset, rows[:half]), _build_split(dataset, rows[half:])]
        )


def to_table(
    dataset: str, rows: list[dict[str, Any]]
) -> tuple[pa.Table, list[tuple[dict[str, Any], str]]]:
    """Rows → a table of the dataset's schema, plus the rows that cannot be in it and why.

    Rows come from `journal.prepare_row` (token lists as arrays) or straight from a caller (plain
    lists); both work. One bad row (a string where an int belongs, a missing required id) must not
    hold every other row hostage, so on failure rows are converted one by one and the bad ones
    returned for the dead-letter file. ``from_pylist`` does not enforce non-nullable fields; we do,
    because the Parquet writer would reject the whole table later.
    """
    schema = SCHEMAS[dataset]
    rejected: list[tuple[dict[str, Any], str]] = []
    try:
        table = _build_split(dataset, rows)
    except _CONVERT_ERRORS:
        parts = []
        for row in rows:
            try:
                parts.append(_build_split(dataset, [row]))
            except _CONVERT_ERRORS as exc:
                rejected.append((row, f"{type(exc).__name__}: {exc}"))
        table = pa.concat_tables(parts) if parts else schema.empty_table()
    required = [f.name for f in schema if not f.nullable and table.column(f.name).null_count]
    if required:
        missing = pc.is_null(table.column(required[0]))
        for name in required[1:]:
            missing = pc.or_(missing, pc.is_null(table.column(name)))
        for i in pc.indices_nonzero(missing).to_pylist():
            row = table.slice(i, 1).to_pylist()[0]
            absent = [n for n in required if row.get(n) is None]
            rejected.append((row, f"required column(s) {', '.join(absent)} missing"))
        table = table.filter(pc.invert(missing))
    return table, rejected


def split_by_date(dataset: str, table: pa.Table, now: _dt.datetime) -> list[tuple[str, pa.Table]]:
    """(``YYYY-MM-DD``, rows of that UTC day) for each day present, in first-seen order."""
    if table.num_rows == 0:
        return []
    days = None
    for name in PARTITION_COLUMNS[dataset]:
        col = pc.cast(table.column(name), pa.date32())
        days = col if days is None else pc.coalesce(days, col)
    fallback = pa.scalar(now.date(), pa.date32())
    days = pc.fill_null(days, fallback) if days is not None else pa.repeat(fallback, table.num_rows)
    unique = pc.unique(days)
    if len(unique) == 1:
        return [(unique[0].as_py().isoformat(), table)]
    return [(day.as_py().isoformat(), table.filter(pc.equal(days, day))) for day in unique]


def row_group_rows(table: pa.Table) -> int:
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    return int(max(1, min(ROW_GROUP_MAX_ROWS, ROW_GROUP_TARGET_BYTES // per_row)))


def _statistics_columns(schema: pa.Schema) -> list[str]:
    # Min/max statistics let readers skip row groups by rollout, time or status. On JSON blobs and
    # token lists they are useless and would copy whole request bodies into the footer.
    return [
        f.name
        for f in schema
        if not pa.types.is_list(f.type) and not f.name.endswith("_json") and f.name != "error"
    ]


_STATS = {name: _statistics_columns(schema) for name, schema in SCHEMAS.items()}


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    # Dictionary pages pay off on repeated strings (rollout ids, models, status) and on integer
    # lists (token ids, offsets, masks): a vocabulary's ids become bit-packed indices, which zstd
    # packs tighter than plain int32 (all 151,936 ids of Qwen3's vocabulary in one column chunk:
    # a 0.6 MB dictionary page and 18-bit indices, measured with pyarrow 26). Not on JSON and a
    # request's new text, where every value is new and the dictionary only costs time.
    strings = [
        f.name
        for f in schema
        if pa.types.is_string(f.type)
        and not f.name.endswith("_json")
        and f.name != "request_middle"
    ]
    return strings + [
        f"{f.name}.list.element"
        for f in schema
        if pa.types.is_list(f.type) and pa.types.is_integer(f.type.value_type)
    ]


_DICTIONARY = {name: _dictionary_columns(schema) for name, schema in SCHEMAS.items()}
# zstd level 6 rather than pyarrow's 1: 22 % fewer bytes on the long agent sessions' shards for
# about 0.14 ms more CPU a call on the shard thread (docs/store.md, "Row groups and shard size").
ZSTD_LEVEL = 6


def shard_name(now: _dt.datetime, proxy_id: str, segment: int) -> str:
    return f"part-{now.strftime('%Y%m%dT%H%M%S%fZ')}-{proxy_id}-{segment:08d}.parquet"


class ShardWriter:
    """Writes one dataset's rows as durable shards at a Location."""

    def __init__(self, location: Location, proxy_id: str) -> None:
        self.location = location
        self.proxy_id = proxy_id
        self._dirs: set[str] = set()
        self._last = _dt.datetime.min.replace(tzinfo=_dt.UTC)

    def write(
        self,
        dataset: str,
        table: pa.Table,
        segment: int,
        segments: list[int],
        announce: Callable[[str, str], None] | None = None,
    ) -> list[str]:
        """Write ``table`` (already of the dataset's schema) as one shard per day; returns paths.
        ``announce(dataset, path)`` is called just before each file becomes visible (the rename,
        the upload), so the caller can record it durably first (the manifest's intents).

        Raises on any failure; files of days written before the failure stay (they are complete), and
        the retry writes those rows again — readers dedupe by key, so that costs space, not truth.
        """
        # Strictly increasing per writer, so two shards of one flush never share a name.
        now = max(_dt.datetime.now(_dt.UTC), self._last + _dt.timedelta(microseconds=1))
        self._last = now
        metadata = {
            b"schema_version": str(SCHEMA_VERSION).encode(),
            b"producer": PRODUCER.encode(),
            b"polar_dataset": dataset.encode(),
            b"polar_proxy_id": self.proxy_id.encode(),
            b"polar_segments": ",".join(str(n) for n in sorted(set(segments))).encode(),
        }
        paths = []
        for day, part in split_by_date(dataset, table, now):
            part = part.replace_schema_metadata(metadata)
            directory = self._join(self.location.dataset_dir(dataset), f"date={day}")
            name = shard_name(now, self.proxy_id, segment)
            if self.location.local:
                paths.append(self._write_local(directory, name, part, dataset, announce))
            else:
                paths.append(self._write_remote(directory, name, part, dataset, announce))
        return paths

    def _join(self, *parts: str) -> str:
        return os.path.join(*parts) if self.location.local else posixpath.join(*parts)

    def _options(self, dataset: str, table: pa.Table) -> dict[str, Any]:
        return {
            "compression": "zstd",
            "row_group_size": row_group_rows(table),
            "compression_level": ZSTD_LEVEL,
            "write_statistics": _STATS[dataset],
            "use_dictionary": _DICTIONARY[dataset],
        }

    def _ensure_local_dir(self, directory: str) -> None:
        if directory in self._dirs:
            return
        created = []
        d = directory
        while not os.path.isdir(d):
            created.append(d)
            d = os.path.dirname(d)
        os.makedirs(directory, exist_ok=True)
        for c in created:  # make each new directory entry durable in its parent
            fsync_dir(os.path.dirname(c))
        self._dirs.add(directory)

    def _write_local(
        self,
        directory: str,
        name: str,
        table: pa.Table,
        dataset: str,
        announce: Callable[[str, str], None] | None,
    ) -> str:
        self._ensure_local_dir(directory)
        final = os.path.join(directory, name)
        replace_whole(
            final,
            lambda tmp: pq.write_table(table, tmp, **self._options(dataset, table)),
            tmp=os.path.join(directory, "." + name + TMP_SUFFIX),  # what recovery cleans up
            before_rename=None if announce is None else lambda _: announce(dataset, final),
        )
        return final

    def _write_remote(
        self,
        directory: str,
        name: str,
        table: pa.Table,
        dataset: str,
        announce: Callable[[str, str], None] | None,
    ) -> str:
        fs = self.location.fs
        if directory not in self._dirs:
            # Object stores have no directories: creating one would only add a marker object
            # (and a HeadBucket round trip) per new day.
            if fs.type_name not in OBJECT_STORES:
                fs.create_dir(directory, recursive=True)
            self._dirs.add(directory)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **self._options(dataset, table))
        data = sink.getvalue()
        final = posixpath.join(directory, name)
        if announce is not None:
            announce(dataset, final)
        try:
            with fs.open_output_stream(final) as out:
                out.write(data)
        except BaseException:
            try:
                fs.delete_file(final)
            except Exception:
                pass
            raise
        return final


KEY_COLUMNS = {"calls": ("call_id",), "traces": ("trace_id", "revision")}


def shard_keys(location: Location, intents: list[tuple[str, str]]) -> dict[str, set[tuple]]:
    """dataset -> row keys held by those announced shards that exist (see `journal.Manifest`):
    rows recovery must not write again. A shard that cannot be read is reported and skipped
    (at worst its rows are written twice; readers dedupe)."""
    keys: dict[str, set[tuple]] = {d: set() for d in SCHEMAS}
    wanted = [(d, p) for d, p in intents if d in SCHEMAS]
    if not wanted:
        return keys
    infos = location.fs.get_file_info([p for _, p in wanted])
    for (dataset, path), info in zip(wanted, infos, strict=True):
        if info.type != pafs.FileType.File:
            continue
        try:
            table = pq.read_table(path, columns=list(KEY_COLUMNS[dataset]), filesystem=location.fs)
        except (OSError, pa.ArrowException) as exc:
            log.warning("polar store: cannot read the keys of shard %s: %s", path, exc)
            continue
        columns = [table.column(c).to_pylist() for c in KEY_COLUMNS[dataset]]
        keys[dataset].update(zip(*columns, strict=True))
    return keys


def cleanup_temp_files(
    location: Location, proxy_id: str, stale_s: float = STALE_TMP_S
) -> list[str]:
    """Remove temp shards a crash left behind: this proxy's of any age, other proxies' once stale.

    Only local output has temp files (remote shards are single uploads). Another live proxy sharing
    the directory may be writing its own temp file right now, hence the age rule for theirs.
    """
    if not location.local:
        return []
    removed = []
    now = time.time()
    for dataset in SCHEMAS:
        top = location.dataset_dir(dataset)
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if not name.endswith(TMP_SUFFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    mine = f"-{proxy_id}-" in name
                    if mine or now - os.stat(path).st_mtime > stale_s:
                        os.unlink(path)
                        removed.append(path)
                except FileNotFoundError:
                    continue
    return removed
