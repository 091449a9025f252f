"""`polar-mitm migrate`: rewrite schema-1 and schema-2 calls shards in schema 3's form (store/delta.py).

Old shards read fine through the store's readers as they are. Migrating a schema-1 shard (whole
prompts) reclaims its space: each row is encoded against the previous call of its rollout, in the
order of the shards, as the journal thread would have. Migrating a schema-2 shard makes it safe
for readers without polar-mitm: its rows kept a prompt's suffix under ``prompt_token_ids`` and a
request's middle under ``request_json``; they move to ``prompt_suffix_ids`` / ``request_middle``
(`delta.upgrade_row`), nothing else changes. Each shard is replaced under its own name (written
to a temp file, fsynced, renamed over the old one), so a crash mid-way leaves every shard either
old or new, and running the command again finishes the rest. The journal directory's lock is held
throughout, so it refuses to run while a proxy writes to the output. Local outputs only.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .delta import PromptDelta, upgrade_row
from .files import replace_whole
from .journal import DirectoryLock
from .reader import list_shards
from .schema import CALLS_SCHEMA, SCHEMA_VERSION
from .shards import ShardWriter, resolve_output


@dataclass
class MigrationReport:
    shards: int = 0  # rewritten
    current: int = 0  # already the current schema
    rows: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self) -> str:
        if not self.shards:
            return (
                f"nothing to migrate ({self.current} calls shards already schema {SCHEMA_VERSION})"
            )
        return (
            f"migrated {self.shards} calls shards ({self.rows} rows) to schema {SCHEMA_VERSION}: "
            f"{self.bytes_before / 1e6:.1f} MB -> {self.bytes_after / 1e6:.1f} MB"
        )


def shard_version(path: str) -> int:
    meta = pq.read_schema(path).metadata or {}
    try:
        return int(meta.get(b"schema_version", b"1"))
    except ValueError:
        return 1


def migrate(output: str, journal_dir: str | None = None) -> MigrationReport:
    """Rewrite every schema-1 calls shard under ``output``; see the module doc."""
    location = resolve_output(output)
    if not location.local:
        raise ValueError("migrate works on a local output (copy the shards down, migrate, upload)")
    journal_dir = journal_dir or os.path.join(location.root, "_journal")
    os.makedirs(journal_dir, exist_ok=True)
    lock = DirectoryLock(journal_dir)
    lock.acquire()
    report = MigrationReport()
    try:
        encoder = PromptDelta(max_rollouts=1 << 30)  # a migration sees each rollout through
        options = ShardWriter(location, "migrate")._options
        seen: set[str] = set()
        for path in list_shards(output, "calls"):
            version = shard_version(path)
            if version >= SCHEMA_VERSION:
                report.current += 1
                continue
            old = pq.read_table(path)
            rows = pa.Table.from_batches(old.to_batches(), old.schema).to_pylist()
            for i, row in enumerate(rows):
                if version >= 2:  # encoded already: the parts move to their own columns
                    rows[i] = upgrade_row(row)
                    continue
                if row["call_id"] in seen:  # a crash's duplicate: kept whole (a base is older)
                    continue
                seen.add(row["call_id"])
                for name in ("prompt_token_ids", "output_token_ids"):
                    if row.get(name) is not None:
                        row[name] = array("i", row[name])
                rows[i] = encoder.encode("calls", row)
            table = pa.Table.from_pylist(rows, schema=CALLS_SCHEMA)
            meta = dict(old.schema.metadata or {})
            meta.update(
                {
                    b"schema_version": str(SCHEMA_VERSION).encode(),
                    b"polar_migrated_from": str(version).encode(),
                }
            )
            _replace(path, table.replace_schema_metadata(meta), options("calls", table), report)
            report.shards += 1
            report.rows += len(rows)
    finally:
        lock.release()
    return report


def _replace(path: str, table: pa.Table, options: dict, report: MigrationReport) -> None:
    """The shard rewritten under its own name (see the module doc), its bytes counted."""

    def measure(tmp: str) -> None:
        report.bytes_before += os.path.getsize(path)
        report.bytes_after += os.path.getsize(tmp)

    replace_whole(
        path,
        lambda tmp: pq.write_table(table, tmp, **options),
        tmp=os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".migrate"),
        before_rename=measure,
    )
