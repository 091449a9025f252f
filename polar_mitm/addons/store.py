"""`StoreAddon`: the journal and Parquet shards under `polar_output`."""

from __future__ import annotations

import concurrent.futures

from mitmproxy import ctx

from ..core.record import CallRecord
from ..store import Store
from .options import _errors, _seconds, log


class StoreAddon:
    """Every finished call goes to the journal (fsynced) and from there into Parquet shards."""

    def __init__(self) -> None:
        self.store: Store | None = None
        self._started = False

    def load(self, loader) -> None:
        loader.add_option(
            "polar_output",
            str,
            "./polar-data",
            "Where captured calls and traces go: a local dir, or a URI such as "
            "s3://BUCKET/PREFIX?endpoint_override=HOST:PORT&scheme=http&region=R (credentials from "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, never in the URI; see "
            "docs/store.md).",
        )
        loader.add_option(
            "polar_journal",
            str,
            "",
            "Local journal dir (default: <polar_output>/_journal; required for remote output: one "
            "per proxy).",
        )
        loader.add_option("polar_flush_rows", int, 512, "Write a shard after this many rows.")
        loader.add_option(
            "polar_flush_seconds",
            str,
            "30",
            "Write a shard once its oldest row is this many seconds old (a number, e.g. 30 or 0.5).",
        )
        loader.add_option(
            "polar_durable_replies",
            bool,
            True,
            "Hold the last event of each completed reply (e.g. data: [DONE]) until the call's "
            "record is fsynced in the journal, so a reply a harness saw complete is never lost "
            "to a crash. Costs about one group-committed fsync per call.",
        )

    def configure(self, updated: set[str]) -> None:
        keys = {"polar_output", "polar_journal", "polar_flush_rows", "polar_flush_seconds"}
        if not keys & updated or self._started:
            return
        opts = ctx.options
        try:
            self.store = Store(
                output=opts.polar_output,
                journal_dir=opts.polar_journal or None,
                flush_rows=opts.polar_flush_rows,
                flush_age_s=_seconds("polar_flush_seconds", opts.polar_flush_seconds, zero_ok=False)
                or 30.0,
            )
        except (ValueError, OSError) as e:
            _errors.fail(f"polar_output: {e}")

    def running(self) -> None:
        if self.store is None or self._started:
            return
        try:
            report = self.store.start()
        except (RuntimeError, OSError) as e:  # e.g. another proxy holds this journal dir
            log.error("polar_output: %s", e)
            self.store = None
            return
        self._started = True
        log.info("polar-mitm: writing to %s (%s)", self.store.display_output, report)

    def done(self) -> None:
        if self.store is not None and self._started:
            self.store.close()
            self._started = False

    def call_finished(self, record: CallRecord) -> concurrent.futures.Future[bool] | None:
        """Journal the record; the receipt (when polar_durable_replies) is done once fsynced."""
        if self.store is None:
            return None
        record.proxy_id = self.store.proxy_id
        seq = self.store.append("calls", record.to_row())
        if seq and self._started and ctx.options.polar_durable_replies:
            return self.store.journaled(seq)
        return None
