"""The Store's shard thread: journaled rows to Arrow as they arrive, and shard rounds when a
dataset is due (rows, bytes, age, or a `flush()` / `close()`), each round committed through the
manifest before its segments are deleted.

`ShardThread` is a base of `store.writer.Store`, not a class of its own: the thread's methods
share the Store's state and keep its lock order (``_jlock`` before ``_lock``; see writer.py's
module docstring), so they are one class read in two modules, journal side and shard side. It
uses the Store's ``_lock``, ``_jlock``, ``_pending``, ``_stats``, ``_manifest``, ``_shards``, the
flush settings and counters, and its ``_delete_segments``, ``_error`` and ``_drop``.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .journal import append_rejected, encode_record, fsync_dir, segment_name
from .recovery import load_rows
from .schema import SCHEMAS
from .shards import split_by_date, to_table

log = logging.getLogger("polar_mitm.store.writer")  # one logger for the Store's two halves

# Journaled rows are converted to Arrow once this many are waiting (and always before a flush).
CONVERT_ROWS = 256
CONVERT_BYTES = 4 << 20
# Retry delays after a failed shard write.
SHARD_BACKOFF = (0.5, 30.0)
# Rewrite the manifest without lines of deleted segments once it has this many.
MANIFEST_COMPACT_LINES = 10_000
# A round normally takes a little more than one threshold's worth of rows; a backlog (recovery, an
# outage) is cut into files of at most this many thresholds, so no shard grows without bound.
SHARD_MAX_FACTOR = 2


@dataclass
class Pending:
    """One dataset's journaled rows that are not in shards yet, oldest first.

    Rows are held in memory (``tables`` then ``rows``, from segments ``segs``) or, after recovery
    or a spill, only on disk (``disk``: segment -> rows, re-read a bounded group at a time).
    """

    tables: list[pa.Table] = field(default_factory=list)  # converted
    rows: list[dict[str, Any]] = field(default_factory=list)  # not yet converted (newer)
    rows_bytes: int = 0
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    segs: Counter[int] = field(default_factory=Counter)  # segment -> rows from it, in memory
    disk: Counter[int] = field(default_factory=Counter)  # segment -> rows from it, on disk only
    count: int = 0
    nbytes: int = 0  # journal payload bytes
    oldest: float | None = None  # monotonic time the oldest row was journaled

    def add(self, row: dict[str, Any], seg: int, size: int, now: float) -> None:
        self.rows.append(row)
        self.rows_bytes += size
        self.segs[seg] += 1
        self.count += 1
        self.nbytes += size
        if self.oldest is None:
            self.oldest = now

    def memory_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables) + self.rows_bytes

    def spill(self) -> None:
        """Forget the in-memory copies; the rows stay pending, to be re-read from the journal.
        Only valid when every segment in ``segs`` is closed."""
        self.disk += self.segs
        self.segs = Counter()
        self.tables, self.rows, self.rejected = [], [], []
        self.rows_bytes = self.nbytes = 0

    def then(self, later: Pending) -> Pending:
        """This (older) pending followed by ``later``: used to put back rows whose write failed."""
        merged = Pending(
            tables=self.tables + later.tables,
            rows=self.rows + later.rows,
            rows_bytes=self.rows_bytes + later.rows_bytes,
            rejected=self.rejected + later.rejected,
            segs=self.segs + later.segs,
            disk=self.disk + later.disk,
            count=self.count + later.count,
            nbytes=self.nbytes + later.nbytes,
        )
        olds = [t for t in (self.oldest, later.oldest) if t is not None]
        merged.oldest = min(olds) if olds else None
        return merged


class ShardThread:
    """The shard thread's half of `Store` (see the module docstring)."""

    def _shard_loop(self) -> None:
        while not self._stop_shards.is_set():
            try:
                self._wake.wait(self._next_deadline())
                self._wake.clear()
                if self._stop_shards.is_set():
                    return
                self._convert(force=False)
                self._maybe_spill()
                due, full = self._due()
                if due:
                    self._shard_round(due, full)
            except Exception as exc:  # a bug here must not silently end shard writing
                log.exception("polar store: shard thread error")
                self._error("shard thread error", exc)
                self._stop_shards.wait(1.0)

    def _next_deadline(self) -> float:
        with self._lock:
            now = time.monotonic()
            waits = [1.0]
            for p in self._pending.values():
                if p.oldest is not None:
                    waits.append(p.oldest + self.flush_age_s - now)
            if self._shard_retry_at > now:
                waits = [max(w, self._shard_retry_at - now) for w in waits]
        return max(0.01, min(waits))

    def _due(self) -> tuple[list[str], bool]:
        with self._lock:
            now = time.monotonic()
            forced = self._flush_target > self._flushed_seq or self._flushed_seq < 0
            # An explicit flush() gets one attempt right away, even during a backoff.
            urgent, self._flush_now = self._flush_now and forced, False
            if now < self._shard_retry_at and not urgent:
                return [], False
            if forced:
                return list(SCHEMAS), True
            due = [
                d
                for d, p in self._pending.items()
                if p.count
                and (
                    p.count >= self.flush_rows
                    or p.nbytes >= self.flush_bytes
                    or (p.oldest is not None and now - p.oldest >= self.flush_age_s)
                )
            ]
            return due, False

    def _convert(self, force: bool) -> None:
        """Turn waiting rows into Arrow tables (outside the lock; only this thread converts)."""
        for dataset, p in self._pending.items():
            with self._lock:
                if not p.rows or not (
                    force or len(p.rows) >= CONVERT_ROWS or p.rows_bytes >= CONVERT_BYTES
                ):
                    continue
                rows, p.rows, p.rows_bytes = p.rows, [], 0
            table, rejected = self._to_table(dataset, rows)
            with self._lock:
                # rows added meanwhile are newer than ``rows``, so the converted table goes last
                p.tables.append(table)
                p.rejected.extend(rejected)

    def _to_table(
        self, dataset: str, rows: list[dict[str, Any]]
    ) -> tuple[pa.Table, list[tuple[dict[str, Any], str]]]:
        names = SCHEMAS[dataset].names
        known = set(names)
        for row in rows:
            extra = row.keys() - known
            for key in extra:
                if (dataset, key) not in self._unknown_columns:
                    self._unknown_columns.add((dataset, key))
                    log.warning(
                        "polar store: %s rows have a column %r that is not in the schema; "
                        "it is not stored",
                        dataset,
                        key,
                    )
        table, rejected = to_table(dataset, rows)
        for _row, reason in rejected:
            log.error(
                "polar store: a %s row cannot be stored (%s); kept in %s/rejected.log",
                dataset,
                reason,
                self.journal_dir,
            )
        return table, rejected

    def _shard_round(self, datasets: list[str], full: bool) -> tuple[list[str], str | None]:
        """Write the pending rows of ``datasets`` as shards; returns (paths, first error)."""
        assert self._journal is not None
        with self._jlock, self._lock:
            self._journal.rotate()
            taken = {}
            for d in datasets:
                if self._pending[d].count:
                    taken[d], self._pending[d] = self._pending[d], Pending()
            seq_mark = self._journaled_seq
        paths: list[str] = []
        error = None
        for dataset, p in taken.items():
            try:
                self._commit(dataset, p, paths)
                self._close_round(dataset)
            except Exception as exc:
                error = error or f"{type(exc).__name__}: {exc}"
                self._error(
                    f"writing {dataset} shards failed (rows kept in the journal, retrying)", exc
                )
                with self._lock:
                    self._pending[dataset] = p.then(self._pending[dataset])
                    self._stats["shard_failures"] += 1
        with self._progress:
            now = time.monotonic()
            if error:
                self._shard_retry_at = now + self._shard_delay
                self._shard_delay = min(self._shard_delay * 2, SHARD_BACKOFF[1])
            else:
                self._shard_retry_at = 0.0
                self._shard_delay = SHARD_BACKOFF[0]
                if full:
                    self._flushed_seq = max(self._flushed_seq, seq_mark)
                if not any(p.count for p in self._pending.values()):
                    self._flushed_seq = max(self._flushed_seq, self._journaled_seq)
            self._progress.notify_all()
        return paths, error

    def _commit(self, dataset: str, p: Pending, paths: list[str]) -> None:
        """Write ``p`` as shards (paths appended to ``paths``), then the manifest, then delete the
        segments: each step durable before the next, so a crash between any two writes rows again
        at worst, never loses them. Raises on failure with ``p`` trimmed to what is still unwritten,
        so the retry does not write the same rows twice."""
        while p.disk:  # older than anything in memory
            group = self._disk_group(p.disk)
            rows = load_rows(self.journal_dir, dataset, group, self._skip)
            table, rejected = self._to_table(dataset, rows)
            self._write_pieces(dataset, table, group, paths)
            self._dead_letter(dataset, rejected)
            counts = Counter({n: p.disk.pop(n) for n in group})
            p.count -= sum(counts.values())
            self._finish(dataset, counts)
        if not p.segs:
            return
        if p.rows:
            table, rejected = self._to_table(dataset, p.rows)
            p.tables.append(table)
            p.rejected.extend(rejected)
            p.rows, p.rows_bytes = [], 0
        # No combine_chunks(): the Parquet writer slices row groups across chunks by itself, and
        # a copy of the whole shard would cost ~10% of the flush.
        table = pa.concat_tables(p.tables) if p.tables else SCHEMAS[dataset].empty_table()
        p.tables = [table]
        self._write_pieces(dataset, table, list(p.segs), paths, progress=p)
        p.tables = []
        self._dead_letter(dataset, p.rejected)
        p.rejected = []
        self._finish(dataset, p.segs)

    def _announce(self, dataset: str, path: str) -> None:
        """Called by the shard writer just before a shard becomes visible: see `Manifest`."""
        self._manifest.append_intent(dataset, path)
        self._open_intents.append((dataset, path))

    def _close_round(self, dataset: str) -> None:
        """Every row of the dataset taken by this round is committed: its intents are moot."""
        if any(d == dataset for d, _ in self._open_intents):
            self._manifest.append_done(dataset)
            self._open_intents = [(d, p) for d, p in self._open_intents if d != dataset]

    def _disk_group(self, disk: Counter[int]) -> list[int]:
        """The oldest segments whose rows make about one shard's worth (at least one segment)."""
        group: list[int] = []
        size = rows = 0
        for n in sorted(disk):
            try:
                seg_size = os.path.getsize(os.path.join(self.journal_dir, segment_name(n)))
            except OSError:
                seg_size = 0
            if group and (
                size + seg_size > SHARD_MAX_FACTOR * self.flush_bytes
                or rows + disk[n] > SHARD_MAX_FACTOR * self.flush_rows
            ):
                break
            group.append(n)
            size += seg_size
            rows += disk[n]
        return group

    def _write_pieces(
        self,
        dataset: str,
        table: pa.Table,
        segments: list[int],
        paths: list[str],
        progress: Pending | None = None,
    ) -> None:
        """Write ``table`` as shards of bounded size; with ``progress``, keep its ``tables`` at
        what is still unwritten, so a retry after a failure midway does not write rows twice."""
        per_row = max(1, table.nbytes // max(1, table.num_rows))
        step = max(
            1,
            min(SHARD_MAX_FACTOR * self.flush_rows, SHARD_MAX_FACTOR * self.flush_bytes // per_row),
        )
        while table.num_rows:
            piece, rest = table.slice(0, step), table.slice(step)
            # One file per day, written one at a time, so that progress can say exactly which
            # rows are still unwritten when a later day's upload fails.
            now = _dt.datetime.now(_dt.UTC)
            days = [part for _, part in split_by_date(dataset, piece, now)]
            for k, part in enumerate(days):
                written = self._shards.write(
                    dataset, part, segment=max(segments), segments=segments, announce=self._announce
                )
                if progress is not None:
                    progress.tables = [*days[k + 1 :], rest]
                paths += written
                with self._lock:
                    self._stats["shards_written"] += len(written)
                    self._stats["rows_in_shards"] += part.num_rows
                    self._stats["last_shard"] = (
                        written[-1] if written else self._stats["last_shard"]
                    )
            table = rest

    def _dead_letter(self, dataset: str, rejected: list[tuple[dict[str, Any], str]]) -> None:
        if rejected:
            append_rejected(self.journal_dir, (encode_record(dataset, r) for r, _ in rejected))
            with self._lock:
                self._stats["rejected"] += len(rejected)

    def _finish(self, dataset: str, counts: Counter[int]) -> None:
        """Record that every ``dataset`` row of these segments is in shards, and delete the
        segments that have nothing else pending."""
        entries = [(n, dataset) for n in counts]
        self._manifest.append(entries)
        with self._lock:
            self._committed_live.update(entries)
            assert self._journal is not None
            done = []
            for n, c in counts.items():
                self._outstanding[n] -= c
                if self._outstanding[n] <= 0 and n < self._journal.number:
                    del self._outstanding[n]
                    done.append(n)
        self._delete_segments(done)
        if self._manifest.lines > MANIFEST_COMPACT_LINES:
            fsync_dir(self.journal_dir)
            with self._lock:
                keep = set(self._committed_live)
            self._manifest.rewrite(keep, self._open_intents)

    def _maybe_spill(self) -> None:
        """Bound memory while shards cannot keep up: pending rows beyond ``max_pending_bytes``
        are dropped from memory (they are in the journal) and re-read when writing resumes."""
        with self._lock:
            held = sum(p.memory_bytes() for p in self._pending.values())
        if held <= self.max_pending_bytes:
            return
        assert self._journal is not None
        with self._jlock, self._lock:
            self._journal.rotate()  # spilled rows must all be in closed segments
            for p in self._pending.values():
                p.spill()
            self._stats["spills"] += 1
        log.warning(
            "polar store: %d MiB of rows are waiting for shards (%s); keeping them only in the "
            "journal until writing catches up",
            held >> 20,
            self._stats["last_error"] or "output slower than capture",
        )
