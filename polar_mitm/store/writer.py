"""The Store: rows in from the proxy's event loop, durable journal, Parquet shards out.

Two background threads, so that neither the caller nor capture durability waits on uploads:

- the *journal thread* drains the append queue, encodes a batch, writes it to the current segment
  and fsyncs once (group commit); only then do the rows count as journaled (`sync()` returns);
- the *shard thread* converts journaled rows to Arrow as they arrive (so the Python objects are
  short-lived and a flush is mostly Parquet encoding), and when a dataset passes ``flush_rows`` /
  ``flush_bytes`` / ``flush_age_s`` (or on `flush()` / `close()`) rotates the segment, writes that
  dataset's rows as shards, records ``(segment, dataset)`` in the manifest, and deletes segments all
  of whose rows are in shards. A failed write (output unreachable) puts the rows back, records
  ``stats["last_error"]`` and retries with exponential backoff; the journal keeps them meanwhile.

Memory stays bounded: rows waiting for shards are held as Arrow (4 bytes a token) up to
``max_pending_bytes``; beyond that (a long outage) they are dropped from memory and re-read from the
journal a bounded group of segments at a time, which is also how recovery works.

Two locks, always taken in this order: ``_jlock`` around a journal write+fsync and a rotation,
``_lock`` around the pending rows and progress counters. A batch is written and its rows registered
under ``_jlock``, so a rotation never closes a segment whose rows are not yet pending (which would
let the manifest claim rows that no shard holds); conversion to Arrow needs only ``_lock``, so it
overlaps the GIL-free write and fsync of the next batch.

The Store's commit protocol (journal -> shards -> manifest -> delete segments) and its lock
order are one invariant that every method of the two threads keeps; this module is the Store, its
public API and the journal thread, and `shard_thread.py` is the shard thread's half of the same
class (`ShardThread`, a base of `Store`) with the rows it works on (`Pending`). The parts that
stand alone are apart: `journal`, `shards`, `recovery`, `remote`, `reader`, `schema`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import heapq
import itertools
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections import Counter
from typing import Any

import pyarrow.fs as pafs

from .delta import PromptDelta
from .files import replace_text
from .journal import (
    DirectoryLock,
    Manifest,
    SegmentWriter,
    frame,
    fsync_dir,
    list_segments,
    pack_record,
    prepare_row,
    segment_name,
)
from .recovery import RecoveryReport, scan_journal
from .remote import display_uri
from .schema import SCHEMAS
from .shard_thread import SHARD_BACKOFF, Pending, ShardThread
from .shards import (
    ShardWriter,
    cleanup_temp_files,
    resolve_output,
    shard_keys,
)

log = logging.getLogger(__name__)

PROXY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PROXY_ID_FILE = "proxy_id"

# Journal batches: big enough that one fsync covers a burst, small enough to bound one write.
BATCH_MAX_ROWS = 4096
BATCH_MAX_BYTES = 8 << 20
# Retry delays after a failed journal write (the shard thread's: `SHARD_BACKOFF`).
JOURNAL_BACKOFF = (0.05, 5.0)
DEFAULT_CLOSE_TIMEOUT = 60.0
JOURNAL_DRAIN_S = 10.0


def _new_proxy_id() -> str:
    return secrets.token_hex(4)


class Store(ShardThread):
    """Durable capture store; see the module docstring and docs/design.md, "Record layout".

    ``output`` is a local path or a pyarrow filesystem URI (``s3://bucket/prefix?endpoint_override=…``);
    ``filesystem`` may be given instead of a URI scheme (then ``output`` is the path inside it).
    The journal is always local: with remote output ``journal_dir`` is required.
    ``max_pending_bytes`` (default 4 x ``flush_bytes``) bounds the rows held in memory while
    shards cannot be written; the rest wait in the journal only.
    """

    def __init__(
        self,
        output: str | os.PathLike[str] = "./polar-data",
        *,
        journal_dir: str | os.PathLike[str] | None = None,
        proxy_id: str | None = None,
        flush_rows: int = 512,
        flush_bytes: int = 64 << 20,
        flush_age_s: float = 30.0,
        filesystem: pafs.FileSystem | None = None,
        max_pending_bytes: int | None = None,
    ) -> None:
        self.location = resolve_output(output, filesystem)
        #: ``output`` as it may be printed (credentials hidden; see `remote.display_uri`)
        self.display_output = display_uri(os.fspath(output))
        if journal_dir is None:
            if not self.location.local:
                raise ValueError(
                    f"output {self.display_output} is remote: give a local journal_dir "
                    "(rows are fsynced there before they are uploaded)"
                )
            journal_dir = os.path.join(self.location.root, "_journal")
        journal_dir = os.fspath(journal_dir)
        if "://" in journal_dir:
            raise ValueError(f"journal_dir {journal_dir!r} must be a local directory")
        self.journal_dir = os.path.abspath(journal_dir)
        if flush_rows < 1 or flush_bytes < 1 or not flush_age_s > 0:
            raise ValueError("flush_rows, flush_bytes and flush_age_s must be positive")
        self.flush_rows, self.flush_bytes, self.flush_age_s = flush_rows, flush_bytes, flush_age_s
        # Rows waiting for shards are kept in memory up to this; beyond it (a long outage of the
        # output, or output slower than capture) they are kept only in the journal.
        self.max_pending_bytes = max_pending_bytes or 4 * flush_bytes
        self._proxy_id_generated = proxy_id is None
        if proxy_id is None:
            proxy_id = self._load_proxy_id() or _new_proxy_id()
        elif not PROXY_ID_RE.match(proxy_id):
            raise ValueError(f"proxy_id {proxy_id!r}: use 1-64 of [A-Za-z0-9._-]")
        self.proxy_id = proxy_id

        self._queue: queue.SimpleQueue[tuple[int, str, dict[str, Any]]] = queue.SimpleQueue()
        self._append_lock = threading.Lock()  # orders seq numbers with queue order
        self._seq = 0
        self._accepting = True
        self._drop_lock = threading.Lock()

        # Two locks, always taken in this order: ``_jlock`` around a journal write+fsync and
        # around a rotation, ``_lock`` around pending rows and progress. Converting rows to Arrow
        # needs only ``_lock``, so it overlaps the (GIL-free) write and fsync of the next batch.
        self._jlock = threading.Lock()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._journal: SegmentWriter | None = None
        self._manifest = Manifest(self.journal_dir)
        self._committed_live: set[tuple[int, str]] = set()
        # shards announced in the manifest whose round has not closed yet (kept by a compaction)
        self._open_intents: list[tuple[str, str]] = []
        self._pending = {d: Pending() for d in SCHEMAS}
        self._delta = PromptDelta()  # the journal thread's: prompts as base + suffix
        self._outstanding: Counter[int] = Counter()
        self._skip: dict[int, set[int]] = {}  # recovery: superseded records per segment
        self._keep: set[int] = set()  # unreadable leftover segments: never deleted by us
        self._journaled_seq = 0
        # journaled() futures waiting for a sequence number: (seq, tiebreak, future), a heap
        self._waiters: list[tuple[int, int, concurrent.futures.Future[bool]]] = []
        self._waiter_ids = itertools.count()
        self._flushed_seq = 0
        self._flush_target = 0
        self._flush_now = False
        self._shard_retry_at = 0.0
        self._shard_delay = SHARD_BACKOFF[0]
        self._unknown_columns: set[tuple[str, str]] = set()

        self._shards = ShardWriter(self.location, self.proxy_id)
        self._dirlock = DirectoryLock(self.journal_dir)
        self._state = "new"  # new -> running -> closed
        self._close_lock = threading.Lock()
        self._wake = threading.Event()  # wakes the shard thread
        self._stop_journal = threading.Event()
        self._stop_shards = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats: dict[str, Any] = dict.fromkeys(
            (
                "appended",
                "journaled",
                "dropped",
                "rejected",
                "fsyncs",
                "journal_bytes",
                "journal_failures",
                "shards_written",
                "rows_in_shards",
                "shard_failures",
                "segments_deleted",
                "recovered_rows",
                "spills",
            ),
            0,
        )
        self._stats.update(last_error=None, last_error_at=None, last_shard=None)

    # -- public API -------------------------------------------------------------------------------

    def start(self) -> RecoveryReport:
        """Recover what a previous run left, then start the writer threads.

        Raises only for start-up problems the operator must fix (journal dir not writable, or in
        use by another store). An unreachable output is not one: the recovered rows stay in the
        journal, ``report.error`` says why, and the shard thread keeps retrying.
        """
        with self._close_lock:
            if self._state != "new":
                raise RuntimeError("Store.start() called twice, or after close()")
            os.makedirs(self.journal_dir, exist_ok=True)
            self._dirlock.acquire()
            try:
                if self._proxy_id_generated and self._load_proxy_id() is None:
                    self._save_proxy_id()
                report = self._recover()
            except BaseException:
                self._dirlock.release()
                raise
            self._threads = [
                threading.Thread(
                    target=self._journal_loop, name="polar-store-journal", daemon=True
                ),
                threading.Thread(target=self._shard_loop, name="polar-store-shards", daemon=True),
            ]
            for t in self._threads:
                t.start()
            self._state = "running"
            atexit.register(self.close)
        if not report.clean:
            (log.warning if report.error or report.damaged else log.info)("%s", report)
        return report

    def append(self, dataset: str, row: dict[str, Any]) -> int:
        """Queue a row; never blocks on I/O and never raises. Returns the row's sequence number
        (for `journaled`), 0 when the row was dropped.

        ``row`` is keyed by schema column names (missing = null; timestamps as int microseconds
        since the epoch, UTC, or datetimes; list columns as lists). The store takes ownership: do
        not mutate the dict or its lists afterwards (they are read by the journal thread). Rows
        that cannot be stored are counted in ``stats`` ("dropped" when they cannot be encoded,
        "rejected" when they do not fit the schema, kept in ``<journal_dir>/rejected.log``).
        """
        try:
            if dataset not in SCHEMAS:
                self._drop(f"unknown dataset {dataset!r}")
                return 0
            if not isinstance(row, dict):
                self._drop(f"{dataset} row is a {type(row).__name__}, not a dict")
                return 0
            with self._append_lock:
                if not self._accepting:
                    self._drop("store is closed")
                    return 0
                self._seq += 1
                self._queue.put((self._seq, dataset, row))
                self._stats["appended"] += 1
                return self._seq
        except Exception as exc:  # pragma: no cover - defensive: append must never raise
            log.error("polar store: append failed: %s", exc)
            return 0

    def journaled(self, seq: int | None = None) -> concurrent.futures.Future[bool]:
        """A future that becomes True once row ``seq`` (default: every row appended so far) is
        fsynced in the journal, or False if the store closes first. The non-blocking form of
        `sync`, for an event loop: ``await asyncio.wrap_future(store.journaled(seq))``.

        The journal thread resolves it right after the batch's fsync, so it costs the caller no
        extra I/O; a row dropped by `append` (seq 0) is resolved at once.
        """
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        target = self._seq if seq is None else seq
        with self._progress:
            if self._journaled_seq >= target:
                done = True
            elif self._state == "closed":
                done = False
            else:
                heapq.heappush(self._waiters, (target, next(self._waiter_ids), future))
                return future
        future.set_running_or_notify_cancel()
        future.set_result(done)
        return future

    def _resolve_waiters(self, everything: bool = False) -> None:
        """Resolve the journaled() futures that are due (all of them when closing); called
        without the lock held, since resolving runs the futures' callbacks."""
        with self._progress:
            due = []
            while self._waiters and (everything or self._waiters[0][0] <= self._journaled_seq):
                seq, _, future = heapq.heappop(self._waiters)
                due.append((future, seq <= self._journaled_seq))
        for future, ok in due:
            # set_running_or_notify_cancel: False when the waiter gave up (an asyncio
            # wrap_future cancels it), and from then on no other thread can cancel it
            if future.set_running_or_notify_cancel():
                future.set_result(ok)

    def sync(self, timeout: float | None = None) -> bool:
        """Block until every row appended so far is fsynced in the journal; False on timeout."""
        target = self._seq
        with self._progress:
            return (
                self._progress.wait_for(
                    lambda: self._journaled_seq >= target or self._state != "running", timeout
                )
                and self._journaled_seq >= target
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every row appended so far is in durable shards; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        target = self._seq
        if not self.sync(timeout):
            return False
        with self._progress:
            self._flush_target = max(self._flush_target, target)
            self._flush_now = True
        self._wake.set()
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._progress:
            return (
                self._progress.wait_for(
                    lambda: self._flushed_seq >= target or self._state != "running", remaining
                )
                and self._flushed_seq >= target
            )

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT) -> None:
        """Flush, stop the threads, release the journal. Idempotent; safe from atexit.

        Rows that cannot reach shards within ``timeout`` (output unreachable) stay in the journal and
        are recovered by the next `start()` or ``polar-mitm recover``: nothing is lost by giving up.
        """
        with self._close_lock:
            if self._state != "running":
                with self._append_lock:
                    self._accepting = False
                if self._state == "new" and not self._queue.empty():
                    log.error(
                        "polar store: %d row(s) appended before start() were never stored",
                        self._queue.qsize(),
                    )
                self._state = "closed"
                self._resolve_waiters(everything=True)
                return
            deadline = None if timeout is None else time.monotonic() + timeout

            def left() -> float | None:
                return None if deadline is None else max(0.0, deadline - time.monotonic())

            flushed = self.flush(left())
            with self._append_lock:
                self._accepting = False  # from here on the queue only shrinks
            # Draining the queue into the journal is local I/O and is what makes appended rows
            # durable, so it gets a grace period even when the flush timeout is spent.
            self._stop_journal.set()
            self._threads[0].join(None if deadline is None else max(left() or 0.0, JOURNAL_DRAIN_S))
            if flushed and self._seq > self._flushed_seq:  # rows appended while closing
                flushed = self.flush(left())
            self._stop_shards.set()  # also ends a journal thread stuck in its retry backoff
            self._wake.set()
            self._threads[0].join(1.0)
            self._threads[1].join(None if deadline is None else max(left() or 0.0, 1.0))
            alive = [t.name for t in self._threads if t.is_alive()]
            if not alive:
                with self._jlock:
                    if self._journal is not None:
                        self._journal.close()
            with self._progress:
                self._state = "closed"
                leftover = sum(p.count for p in self._pending.values()) + self._queue.qsize()
                self._progress.notify_all()
            self._resolve_waiters(everything=True)
            if not alive and leftover == 0 and not list_segments(self.journal_dir):
                try:
                    fsync_dir(self.journal_dir)  # segment deletions before the manifest goes
                    self._manifest.rewrite([])
                except OSError as exc:
                    log.warning("polar store: could not clear the manifest: %s", exc)
            if leftover:
                log.warning(
                    "polar store: %d row(s) are not in shards yet (%s); they are safe in %s and "
                    "will be written by the next start or `polar-mitm recover`",
                    leftover,
                    self._stats["last_error"] or "close timeout",
                    self.journal_dir,
                )
            atexit.unregister(self.close)
            if alive:
                # Still writing (a hung upload or disk): keep the journal locked until the process
                # exits, so no other store can work on it beside them.
                log.warning("polar store: %s still running after close()", ", ".join(alive))
                return
            self._dirlock.release()

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (plus ``queued`` and ``pending_rows`` right now).

        Lock-free on purpose: the proxy's event loop may read it while the journal thread holds
        the lock across an fsync.
        """
        out = dict(self._stats)
        out["pending_rows"] = sum(p.count for p in list(self._pending.values()))
        out["fsyncs"] = self._journal.fsyncs if self._journal is not None else 0
        out["queued"] = self._queue.qsize()
        return out

    def __enter__(self) -> Store:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- start-up ---------------------------------------------------------------------------------

    def _load_proxy_id(self) -> str | None:
        try:
            with open(os.path.join(self.journal_dir, PROXY_ID_FILE), encoding="utf-8") as f:
                value = f.read().strip()
        except OSError:
            return None
        return value if PROXY_ID_RE.match(value) else None

    def _save_proxy_id(self) -> None:
        # A stable id across restarts lets recovery recognise this proxy's own temp files.
        path = os.path.join(self.journal_dir, PROXY_ID_FILE)
        replace_text(path, self.proxy_id + "\n", tmp=path + ".tmp")

    def _recover(self) -> RecoveryReport:
        report = RecoveryReport(self.journal_dir)
        try:
            report.temp_files_removed = cleanup_temp_files(self.location, self.proxy_id)
        except OSError as exc:
            log.warning("polar store: could not clean temp shards: %s", exc)
        committed = self._manifest.load()
        published: dict[str, set[tuple[Any, ...]]] = {}
        if self._manifest.intents:
            # A round of several shards was cut short: rows of the shards it managed to publish
            # must not be written again (their segments are not in the manifest).
            try:
                published = shard_keys(self.location, self._manifest.intents)
            except OSError as exc:  # output unreachable: at worst rows are written twice
                log.warning("polar store: cannot check the shards of an unfinished round: %s", exc)
            self._open_intents = list(self._manifest.intents)
        scan = scan_journal(self.journal_dir, committed, report, published)
        highest = max([n for n, _ in committed] + scan.segments + scan.unreadable, default=0)
        self._journal = SegmentWriter(self.journal_dir, highest + 1)
        now = time.monotonic()
        for dataset, counts in scan.counts.items():
            p = self._pending[dataset]
            p.disk += counts
            p.count += sum(counts.values())
            p.oldest = now if p.count else None
            self._outstanding += counts
        self._skip = scan.skip
        self._keep = set(scan.unreadable)
        live = set(scan.segments) | self._keep
        self._committed_live = {(n, d) for n, d in committed if n in live}
        self._delete_segments([n for n in scan.segments if self._outstanding[n] == 0])
        fsync_dir(self.journal_dir)
        self._manifest.rewrite(self._committed_live, self._open_intents)
        recovered = report.recovered_rows
        self._stats["recovered_rows"] = recovered
        if recovered:
            self._flushed_seq = -1  # flush() and close() wait for the recovered rows too
            self._flush_target = 0
            paths, error = self._shard_round(list(SCHEMAS), full=True)
            report.shards = paths
            report.error = error
        return report

    # -- journal thread ---------------------------------------------------------------------------

    def _journal_loop(self) -> None:
        batch: tuple[list[bytes], list[tuple[str, dict[str, Any], int]], int] | None = None
        delay = JOURNAL_BACKOFF[0]
        while True:
            try:
                if batch is None:
                    batch = self._next_batch()
                    if batch is None:
                        if self._stop_journal.is_set() and self._queue.empty():
                            return
                        continue
                self._write_batch(*batch)
                batch = None
                delay = JOURNAL_BACKOFF[0]
            except Exception as exc:
                self._error("journal write failed (rows kept in memory, retrying)", exc)
                self._stats["journal_failures"] += 1
                self._cleanup_abandoned()
                self._stop_shards.wait(delay)  # only a hard stop cuts the backoff short
                delay = min(delay * 2, JOURNAL_BACKOFF[1])
                if self._stop_shards.is_set():
                    return

    def _next_batch(self) -> tuple[list[bytes], list[tuple[str, dict[str, Any], int]], int] | None:
        try:
            item = self._queue.get(timeout=0.2)
        except queue.Empty:
            return None
        frames: list[bytes] = []
        regs: list[tuple[str, dict[str, Any], int]] = []
        size = 0
        last_seq = item[0]
        while True:
            seq, dataset, row = item
            last_seq = seq
            try:
                row = self._delta.encode(dataset, prepare_row(dataset, row))
                payload = pack_record(dataset, row)
            except Exception as exc:
                self._drop(f"{dataset} row cannot be encoded ({exc})")
            else:
                frames.append(frame(payload))
                regs.append((dataset, row, len(payload)))
                size += len(payload)
            if len(frames) >= BATCH_MAX_ROWS or size >= BATCH_MAX_BYTES:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        return frames, regs, last_seq

    def _write_batch(
        self, frames: list[bytes], regs: list[tuple[str, dict[str, Any], int]], last_seq: int
    ) -> None:
        assert self._journal is not None
        with self._jlock:
            # Registered before _jlock is released, so a rotation never closes a segment whose
            # rows are not pending yet (the manifest would then claim rows no shard holds).
            seg = self._journal.write_batch(frames) if frames else 0
            with self._progress:
                now = time.monotonic()
                for dataset, row, size in regs:
                    self._pending[dataset].add(row, seg, size, now)
                if regs:
                    self._outstanding[seg] += len(regs)
                self._stats["journaled"] += len(regs)
                self._stats["journal_bytes"] += sum(len(f) for f in frames)
                self._journaled_seq = last_seq
                self._progress.notify_all()
        self._resolve_waiters()
        self._wake.set()

    def _cleanup_abandoned(self) -> None:
        """After a failed write the segment was abandoned; if it holds no registered rows, its
        content is being retried elsewhere and the file can go."""
        with self._jlock, self._lock:
            if self._journal is None:
                return
            stale = [
                n
                for n, _ in list_segments(self.journal_dir)
                if n < self._journal.number
                and self._outstanding[n] == 0
                and not any(k == n for k, _ in self._committed_live)
            ]
        self._delete_segments(stale, quiet=True)

    def _delete_segments(self, numbers: list[int], quiet: bool = False) -> None:
        for n in numbers:
            if n in self._keep:
                continue
            try:
                os.unlink(os.path.join(self.journal_dir, segment_name(n)))
            except FileNotFoundError:
                continue
            except OSError as exc:
                if not quiet:
                    log.warning("polar store: could not delete journal segment %d: %s", n, exc)
                continue
            with self._lock:
                self._stats["segments_deleted"] += 1
                self._committed_live = {(k, d) for k, d in self._committed_live if k != n}
                self._skip.pop(n, None)

    # -- errors -----------------------------------------------------------------------------------

    def _error(self, what: str, exc: BaseException) -> None:
        message = f"{what}: {type(exc).__name__}: {exc}"
        log.error("polar store: %s", message)
        self._stats["last_error"] = message
        self._stats["last_error_at"] = time.time()

    def _drop(self, why: str) -> None:
        """Count and log a row that can never be stored (the caller's bug, or append after close);
        the log is rate-limited so a bug in a hot path cannot flood it."""
        with self._drop_lock:
            self._stats["dropped"] += 1
            n = self._stats["dropped"]
        if n <= 10 or n % 1000 == 0:
            log.error("polar store: row dropped (%d so far): %s", n, why)


def recover(
    output: str | os.PathLike[str],
    journal_dir: str | os.PathLike[str] | None = None,
    filesystem: pafs.FileSystem | None = None,
    timeout: float | None = 60.0,
) -> RecoveryReport:
    """Turn a crashed run's journal into shards and return what was done (``polar-mitm recover``).

    Takes the journal's lock, so it refuses to run beside a live proxy on the same journal. When the
    output is unreachable the rows stay in the journal and ``report.error`` says why.
    """
    store = Store(output, journal_dir=journal_dir, filesystem=filesystem)
    report = store.start()
    store.close(timeout=0 if report.error else timeout)
    return report
