"""Prometheus metrics of a running proxy: ``GET /metrics`` on the control plane's port.

The ecosystem's convention (vLLM and SGLang serve ``/metrics`` too), with the official
``prometheus_client`` library, one registry per proxy. Two kinds of figures:

- counted once per call, when its record is final (`MetricsAddon.call_finished`, a `CallSink`
  after the fidelity checks, so a record's flags are known): calls by dialect, harness, status and
  route; tokens sampled and prompted; time to first byte; fidelity flags by kind; upstream errors
  by kind. At call end, not per chunk: a handful of dict look-ups and lock-protected adds (timed
  by polar_bench/metrics.py, docs/metrics.md "Cost");
- read when scraped (`_Live`): calls in flight and waiting at a pause, whether paused, open
  rollouts, journal lag (records not yet in shards), shard flushes and failures. Nothing on the
  hot path.

Added latency is the proxy's share of the time to first byte: the harness's time to first byte
minus the upstream's (request sent to its first body bytes), per call that reached an upstream.

Names (all ``polar_``): see `METRICS` below; docs/metrics.md has the table and PromQL examples.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .core.record import CallRecord
from .core.record_facts import checked_with_tokenizer, harness_of_agent

log = logging.getLogger(__name__)
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ADDED_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# an upstream failure's kind, from the one-line error the call records (call/exchange.py's wording)
_UPSTREAM_ERRORS = (
    (re.compile(r"returned HTTP (4\d\d)"), "http_4xx"),
    (re.compile(r"returned HTTP (5\d\d)"), "http_5xx"),
    (re.compile(r"did not accept a connection"), "connect_timeout"),
    (re.compile(r"is unreachable"), "unreachable"),
    (re.compile(r"sent nothing for"), "stalled"),
    (re.compile(r"closed the connection"), "disconnected"),
    (re.compile(r"ended the stream|error mid-stream"), "stream_failed"),
    (
        re.compile(r"not valid JSON|malformed|is not a chat completion|has no finish_reason"),
        "bad_reply",
    ),
)
# the User-Agent value in `CallRecord.headers_json` (json.dumps of lower-cased header names)
_USER_AGENT = re.compile(r'"user-agent": "((?:[^"\\]|\\.)*)"')
METRICS = {
    "polar_calls_total": "LLM calls finished, by dialect, harness, status and route",
    "polar_tokens_sampled_total": "tokens the policy sampled (output ids), by dialect",
    "polar_tokens_prompted_total": "prompt tokens sent to the policy (prompt ids), by dialect",
    "polar_time_to_first_byte_seconds": "harness's time to first byte, by dialect",
    "polar_added_latency_seconds": "the proxy's share of the time to first byte",
    "polar_durable_hold_seconds": "how long a completed reply's last event waited for its "
    "record's fsync (polar_durable_replies)",
    "polar_fidelity_flags_total": "calls carrying each fidelity flag",
    "polar_fidelity_checked_calls_total": "calls the fidelity checks ran on with the tokenizer",
    "polar_upstream_errors_total": "calls that failed at the upstream, by kind",
    "polar_calls_in_flight": "calls being answered now",
    "polar_calls_waiting": "calls waiting at a pause (control plane)",
    "polar_paused": "1 while the control plane holds new calls",
    "polar_rollouts_open": "rollouts with calls and not ended",
    "polar_rollouts_ended_empty_total": "rollouts ended with zero captured calls (their harness "
    "never went through the proxy)",
    "polar_journal_lag_records": "records journaled or queued but not yet in shards",
    "polar_shard_flushes_total": "shards written",
    "polar_shard_failures_total": "shard writes that failed (retried)",
}


def upstream_error_kind(record: CallRecord) -> str | None:
    """The kind of upstream failure a record shows, or None when it did not fail upstream."""
    if record.status != "error" or not record.error or not record.error.startswith("upstream"):
        return None
    for pattern, kind in _UPSTREAM_ERRORS:
        if pattern.search(record.error):
            return kind
    return "other"


class _Live(Collector):
    """Gauges read from the proxy's state when scraped (no cost per call)."""

    def __init__(self, control: Any, rollouts: Any, store: Any) -> None:
        self.control, self.rollouts, self.store = control, rollouts, store

    def collect(self) -> Iterator[Metric]:
        c = self.control
        for name, value in (
            ("polar_calls_in_flight", len(c.in_flight)),
            ("polar_calls_waiting", c.waiting),
            ("polar_paused", int(c.paused)),
            ("polar_rollouts_open", len(self.rollouts.open)),
        ):
            yield GaugeMetricFamily(name, METRICS[name], value=value)
        yield CounterMetricFamily(
            "polar_rollouts_ended_empty",
            METRICS["polar_rollouts_ended_empty_total"],
            value=c.ended_empty,
        )
        store = self.store.store
        if store is None:
            return
        stats = store.stats
        lag = stats["queued"] + stats["pending_rows"]
        yield GaugeMetricFamily(
            "polar_journal_lag_records", METRICS["polar_journal_lag_records"], value=lag
        )
        for name, key in (
            ("polar_shard_flushes", "shards_written"),
            ("polar_shard_failures", "shard_failures"),
        ):
            yield CounterMetricFamily(name, METRICS[f"{name}_total"], value=stats[key])


class ProxyMetrics:
    """The registry and the per-call instruments of one proxy."""

    def __init__(self, control: Any, rollouts: Any, store: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, labels: tuple[str, ...]) -> Counter:
            return Counter(name, METRICS[f"{name}_total"], labels, registry=r)

        self.calls = counter("polar_calls", ("dialect", "harness", "status", "route"))
        self.sampled = counter("polar_tokens_sampled", ("dialect",))
        self.prompted = counter("polar_tokens_prompted", ("dialect",))
        self.flags = counter("polar_fidelity_flags", ("flag",))
        self.checked = counter("polar_fidelity_checked_calls", ())
        self.upstream_errors = counter("polar_upstream_errors", ("kind",))
        self.ttfb = Histogram(
            "polar_time_to_first_byte_seconds",
            METRICS["polar_time_to_first_byte_seconds"],
            ("dialect",),
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.added = Histogram(
            "polar_added_latency_seconds",
            METRICS["polar_added_latency_seconds"],
            buckets=ADDED_BUCKETS,
            registry=r,
        )
        self.hold = Histogram(
            "polar_durable_hold_seconds",
            METRICS["polar_durable_hold_seconds"],
            buckets=ADDED_BUCKETS,
            registry=r,
        )
        r.register(_Live(control, rollouts, store))
        self._harness: dict[str, str] = {}  # user-agent -> harness name
        self._calls: dict[tuple[str, str, str, str], Any] = {}  # labels -> counter child
        self._dialects: dict[str, tuple[Any, Any, Any]] = {}  # sampled, prompted, ttfb

    def record(self, record: CallRecord) -> None:
        """Count one finished call (its final record). Labelled children are cached: a
        `labels()` look-up costs more than the increment itself."""
        dialect = record.dialect or "unknown"
        key = (
            dialect,
            self._harness_of(record.headers_json),
            record.status,
            record.route or "chat",
        )
        calls = self._calls.get(key)
        if calls is None:
            calls = self._calls[key] = self.calls.labels(*key)
        calls.inc()
        per = self._dialects.get(dialect)
        if per is None:
            per = self._dialects[dialect] = (
                self.sampled.labels(dialect),
                self.prompted.labels(dialect),
                self.ttfb.labels(dialect),
            )
        if record.output_token_ids:
            per[0].inc(len(record.output_token_ids))
        if record.prompt_token_ids:
            per[1].inc(len(record.prompt_token_ids))
        if record.first_byte_at is not None:
            per[2].observe((record.first_byte_at - record.started_at) / 1e6)
        for flag in record.fidelity_flags:
            self.flags.labels(flag).inc()
        if checked_with_tokenizer(record.fidelity_json):
            self.checked.inc()
        if record.status == "error":
            kind = upstream_error_kind(record)
            if kind is not None:
                self.upstream_errors.labels(kind).inc()

    def added_latency(self, call: Any) -> None:
        """The proxy's share of a call's time to first byte (an `exchange.Call` that ended):
        the harness's time to first byte minus the upstream's."""
        r = call.record
        sent, first = call.upstream_sent_at, call.upstream_first_at
        if sent is None or first is None or r.first_byte_at is None:
            return
        added = (r.first_byte_at - r.started_at) - (first - sent)
        if added >= 0:
            self.added.observe(added / 1e6)

    def durable_hold(self, waited_us: int) -> None:
        """How long a completed reply's last event waited for its record to be durable."""
        self.hold.observe(waited_us / 1e6)

    def _harness_of(self, headers_json: str | None) -> str:
        """The harness from the User-Agent (found in the headers' JSON text without parsing it
        all), cached per User-Agent: a farm has a few."""
        found = _USER_AGENT.search(headers_json or "")
        ua = json.loads(f'"{found.group(1)}"') if found else ""
        name = self._harness.get(ua)
        if name is None:
            name = harness_of_agent(ua)
            if len(self._harness) < 1024:  # user-agents are a few; never grow without bound
                self._harness[ua] = name
        return name

    def exposition(self) -> bytes:
        """The text format a Prometheus server scrapes."""
        return generate_latest(self.registry)


class MetricsAddon:
    """`/metrics` on the control plane's port (`polar_control_listen`); the bearer token is
    needed unless `polar_metrics_public`. Also the sink that counts each final record."""

    def __init__(self, control: Any, rollouts: Any, store: Any) -> None:
        self.metrics = ProxyMetrics(control, rollouts, store)
        self.public = False

    def load(self, loader: Any) -> None:
        loader.add_option(
            "polar_metrics_public",
            bool,
            False,
            "Serve GET /metrics (Prometheus) on polar_control_listen without the control token "
            "(figures only: no ids, no text). Off: a scraper sends Authorization: Bearer <token>.",
        )

    def configure(self, updated: set[str]) -> None:
        from mitmproxy import ctx

        if "polar_metrics_public" in updated:
            self.public = bool(ctx.options.polar_metrics_public)

    def call_finished(self, record: CallRecord) -> None:
        self.metrics.record(record)
