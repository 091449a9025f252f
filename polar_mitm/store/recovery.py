"""Recovery: what a crashed (or killed, or power-cut) run left in the journal, made into shards once.

Called by `Store.start()` before the writer threads run (and so by `writer.recover()`, ``polar-mitm
recover``). This module never imports the writer: the Store owns the commit protocol and calls in.
The rules, in the order they apply:

1. temp shards (``.part-….parquet.tmp``) under the output are removed (see `cleanup_temp_files`);
2. every leftover segment is read up to its first damaged frame; the damage (a torn tail from a crash
   mid-write, or garbage) is reported with ONE warning naming the file and offset, never raised;
3. records of a (segment, dataset) already in the manifest are skipped: their shards exist; so are
   records whose key is in a shard the manifest announced (an ``intent``) and that exists — a crash
   in the middle of a round of several shards, before its segments were committed;
4. the remaining rows are deduplicated by key — ``call_id`` for calls, ``(trace_id, revision)`` for
   traces — keeping the last journaled copy (a row journaled twice, e.g. after a failed write that
   was retried into the next segment, is written once);
5. those rows become shards, the manifest records it, and the segments are deleted.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .delta import upgrade_row
from .journal import Damage, decode_record, list_segments, read_segment, segment_name
from .schema import SCHEMAS

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    """What `Store.start()` / `recover()` found and did; ``str()`` gives a one-line summary."""

    journal_dir: str
    segments: int = 0  # leftover segment files found
    segments_already_committed: int = 0  # deleted without rewriting: all their rows were in shards
    records: int = 0  # intact records read
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCHEMAS, 0))  # recovered
    already_committed: int = 0  # records skipped because the manifest lists their segment
    duplicates: int = 0  # records dropped because a later copy of the same key exists
    invalid_records: int = 0  # intact frames that are not journal records (or name no dataset)
    damaged: list[Damage] = field(default_factory=list)  # torn / corrupt tails, one per file
    unreadable: list[str] = field(default_factory=list)  # segments left in place (I/O errors)
    temp_files_removed: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)  # shards written from the recovered rows
    error: str | None = None  # set when the recovered rows could not be written yet (retried)

    @property
    def recovered_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def clean(self) -> bool:
        """Nothing was left over: the previous run closed properly."""
        return not (self.segments or self.temp_files_removed)

    def __str__(self) -> str:
        if self.clean:
            return f"journal {self.journal_dir}: clean, nothing to recover"
        rows = ", ".join(f"{n} {d}" for d, n in self.rows.items())
        parts = [
            f"journal {self.journal_dir}: {self.segments} leftover segment(s)",
            f"recovered {rows}",
            f"into {len(self.shards)} shard(s)",
        ]
        if self.segments_already_committed:
            parts.append(f"{self.segments_already_committed} segment(s) were already in shards")
        if self.duplicates:
            parts.append(f"{self.duplicates} duplicate(s) dropped")
        if self.damaged:
            parts.append(f"{len(self.damaged)} damaged tail(s) skipped")
        if self.invalid_records:
            parts.append(f"{self.invalid_records} invalid record(s) skipped")
        if self.unreadable:
            parts.append(f"{len(self.unreadable)} unreadable segment(s) left in place")
        if self.temp_files_removed:
            parts.append(f"{len(self.temp_files_removed)} temp file(s) removed")
        if self.error:
            parts.append(f"NOT YET WRITTEN ({self.error}); kept in the journal and retried")
        return "; ".join(parts)


@dataclass
class Scan:
    """Leftover journal content, as locations only: what to shard is re-read from the segments a
    bounded group at a time, so recovering a journal larger than memory works."""

    segments: list[int]  # every readable leftover segment number
    unreadable: list[int]  # segments that could not be read: left in place, never deleted
    counts: dict[str, Counter[int]]  # dataset -> segment -> rows to shard from it
    skip: dict[int, set[int]]  # segment -> record indexes superseded by a later copy


def _key(dataset: str, row: dict[str, Any], unique: object) -> tuple[Any, ...]:
    if dataset == "calls":
        k = row.get("call_id")
        return ("c", k) if k is not None else ("?", unique)
    k = row.get("trace_id")
    return ("t", k, row.get("revision")) if k is not None else ("?", unique)


def scan_journal(
    journal_dir: str,
    committed: Iterable[tuple[int, str]],
    report: RecoveryReport,
    published: dict[str, set[tuple[Any, ...]]] | None = None,
) -> Scan:
    """Read every leftover segment (rules 2–4 above), filling ``report``; writes nothing and keeps
    only keys and locations in memory. ``published``: dataset -> keys already in shards that no
    committed segment accounts for (`shards.shard_keys`)."""
    committed = set(committed)
    published = published or {}
    segments = list_segments(journal_dir)
    report.segments = len(segments)
    # (dataset, key) -> (segment, index, still to shard)
    latest: dict[tuple[Any, ...], tuple[int, int, bool]] = {}
    counts: dict[str, Counter[int]] = {d: Counter() for d in SCHEMAS}
    skip: dict[int, set[int]] = {}
    readable, unreadable = [], []
    for n, path in segments:
        try:
            payloads, damage = read_segment(path)
        except OSError as exc:
            log.warning("journal %s: unreadable (%s); left in place", path, exc)
            unreadable.append(n)
            report.unreadable.append(path)
            continue
        readable.append(n)
        if damage is not None:
            log.warning("journal %s", damage)
            report.damaged.append(damage)
        report.records += len(payloads)
        fully_committed = True
        for i, payload in enumerate(payloads):
            try:
                dataset, row = decode_record(payload)
            except ValueError:
                report.invalid_records += 1
                skip.setdefault(n, set()).add(i)
                continue
            if dataset not in SCHEMAS:
                report.invalid_records += 1
                skip.setdefault(n, set()).add(i)
                continue
            key = (dataset, *_key(dataset, row, (n, i)))
            earlier = latest.get(key)
            if earlier is not None and earlier[2]:  # an older copy still to shard: superseded
                report.duplicates += 1
                skip.setdefault(earlier[0], set()).add(earlier[1])
                counts[dataset][earlier[0]] -= 1
            if (n, dataset) in committed:  # in shards already; it still supersedes older copies
                report.already_committed += 1
                latest[key] = (n, i, False)
                continue
            if key[2:] in published.get(dataset, ()):  # in a shard of an unfinished round
                report.already_committed += 1
                latest[key] = (n, i, False)
                skip.setdefault(n, set()).add(i)
                continue
            fully_committed = False
            latest[key] = (n, i, True)
            counts[dataset][n] += 1
        if fully_committed and payloads:
            report.segments_already_committed += 1
    for d in SCHEMAS:
        counts[d] = +counts[d]  # drop segments left with nothing to shard
        report.rows[d] = sum(counts[d].values())
    return Scan(readable, unreadable, counts, skip)


def load_rows(
    journal_dir: str, dataset: str, segments: Iterable[int], skip: dict[int, set[int]]
) -> list[dict[str, Any]]:
    """The ``dataset`` rows of ``segments`` (journal order), minus the ``skip``ped records.

    Raises OSError when a segment cannot be read (the caller retries later); a segment that has
    vanished (removed by hand) is reported and skipped, or it would block every later row.
    """
    rows = []
    for n in segments:
        path = os.path.join(journal_dir, segment_name(n))
        try:
            payloads, _ = read_segment(path)
        except FileNotFoundError:
            log.error("journal %s vanished before its rows were written to shards", path)
            continue
        dropped = skip.get(n, ())
        for i, payload in enumerate(payloads):
            if i in dropped:
                continue
            try:
                d, row = decode_record(payload)
            except ValueError:
                continue
            if d == dataset:  # a calls row journaled by schema 2's proxy: in schema 3's form
                rows.append(upgrade_row(row) if d == "calls" else row)
    return rows
