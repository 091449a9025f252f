"""The pure parts of issue 26 on hand-made rows: listings fitted to a width (ids never cut), the
"not checked" verdict, the metrics of one record, and `top`'s histogram median.
(tests/e2e/loopback/test_cli_e2e.py and tests/e2e/loopback/test_metrics_e2e.py run them for
real.)"""

from __future__ import annotations

import csv
import io
import json
import timeit
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from polar_mitm.cli.listing import Column, Listing, emit
from polar_mitm.cli.top import Scrape, quantile
from polar_mitm.control import ControlState
from polar_mitm.core.record import CallRecord
from polar_mitm.core.record_facts import checked_with_tokenizer
from polar_mitm.metrics import ProxyMetrics, upstream_error_kind

IDS = [f"{'r' * 20}.{i}" for i in range(3)]
CALL_IDS = [f"c{i:031x}" for i in range(3)]


def listing() -> Listing:
    columns = [
        Column("rollout"),
        Column("call"),
        Column("tokens", numeric=True, drop=2),
        Column("note", wraps=True, drop=1),
        Column("status", drop=3),
    ]
    out = Listing("a listing", columns)
    for rid, cid in zip(IDS, CALL_IDS, strict=True):
        out.add(rid, cid, 123456789, "a long free text note that may wrap anywhere", "completed")
    out.totals.append(["total", "", "370370367", "", ""])
    return out


def printed(width: int | None) -> str:
    console = Console(
        file=io.StringIO(), width=width or 80, force_terminal=width is not None, color_system=None
    )
    table, at = listing().table(width, console)
    console.width = at
    console.print(table, crop=False)
    return console.file.getvalue()


@pytest.mark.parametrize("width", [None, 40, 60, 80, 100, 200])
def test_a_listing_keeps_ids_and_numbers_whole_at_any_width(width):
    text = printed(width)
    words = [set(line.split()) for line in text.splitlines()]
    for id_ in [*IDS, *CALL_IDS]:
        assert any(id_ in w for w in words), text
    lines = [line.rstrip() for line in text.splitlines()]
    if width is not None and width >= 60:  # the ids alone fit: so does every line
        assert max(len(line) for line in lines) <= width, text
    if width is None or width >= 200:  # room for everything: one line per row
        assert any("a long free text note that may wrap anywhere" in line for line in lines)
    if width is None or width >= 100:  # the figures stay; free text wraps at word boundaries
        assert sum("123456789" in w for w in words) == 3
        assert all(any(word in w for w in words) for word in ("anywhere", "note", "long"))
    for w in words:  # a figure is whole or absent, never a fragment of one
        assert not any(x.isdigit() and x not in ("123456789", "370370367") for x in w), text


def test_plain_is_tab_separated_and_emit_writes_it(capsys):
    emit([listing()], plain=True)
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out), delimiter="\t"))
    assert rows[0] == ["rollout", "call", "tokens", "note", "status"]
    assert [r[:3] for r in rows[1:]] == [
        [i, c, "123456789"] for i, c in zip(IDS, CALL_IDS, strict=True)
    ]


def test_checked_means_checked_with_the_tokenizer():
    assert checked_with_tokenizer(json.dumps({"checked": {"mode": "check", "tokenizer": "/q"}}))
    assert not checked_with_tokenizer(json.dumps({"checked": {"mode": "check", "tokenizer": None}}))
    assert not checked_with_tokenizer(None) and not checked_with_tokenizer("{}")


def record(**kw) -> CallRecord:
    r = CallRecord(rollout_id="t.0", dialect="openai_chat", status="completed")
    r.headers_json = json.dumps({"user-agent": "OpenAI/Python 1.99.0", "accept": "*/*"})
    r.prompt_token_ids, r.output_token_ids = list(range(500)), list(range(40))
    r.first_byte_at = r.started_at + 25_000
    r.fidelity_json = json.dumps({"checked": {"mode": "check", "tokenizer": "/q"}})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_metrics_of_records_and_upstream_error_kinds():
    state = ControlState()
    m = ProxyMetrics(state, SimpleNamespace(open={"t.0": 1}), SimpleNamespace(store=None))
    m.record(record())
    m.record(record(fidelity_flags=["bpe_resplit"]))
    failed = record(status="error", error="upstream http://x returned HTTP 503: busy")
    failed.output_token_ids, failed.first_byte_at = [], None
    m.record(failed)
    call = SimpleNamespace(record=record(), upstream_sent_at=0, upstream_first_at=20_000)
    call.record.started_at, call.record.first_byte_at = 0, 21_500
    m.added_latency(call)
    m.durable_hold(3_000)
    m.durable_hold(1_000)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.exposition().decode())
        for s in f.samples
    }
    key = (("dialect", "openai_chat"), ("harness", "openai-python"), ("route", "chat"))
    assert samples[("polar_calls_total", (*key[:2], key[2], ("status", "completed")))] == 2
    assert samples[("polar_calls_total", (*key[:2], key[2], ("status", "error")))] == 1
    assert samples[("polar_tokens_sampled_total", (("dialect", "openai_chat"),))] == 80
    assert samples[("polar_tokens_prompted_total", (("dialect", "openai_chat"),))] == 1500
    assert samples[("polar_fidelity_flags_total", (("flag", "bpe_resplit"),))] == 1
    assert samples[("polar_fidelity_checked_calls_total", ())] == 3
    assert samples[("polar_upstream_errors_total", (("kind", "http_5xx"),))] == 1
    assert samples[("polar_added_latency_seconds_sum", ())] == pytest.approx(0.0015)
    assert samples[("polar_added_latency_seconds_count", ())] == 1
    assert samples[("polar_durable_hold_seconds_sum", ())] == pytest.approx(0.004)
    assert samples[("polar_durable_hold_seconds_count", ())] == 2
    assert samples[("polar_rollouts_open", ())] == 1 and samples[("polar_calls_in_flight", ())] == 0
    assert upstream_error_kind(record(status="error", error="bad request: no messages")) is None
    for error, kind in [
        ("upstream u did not accept a connection within 10s", "connect_timeout"),
        ("upstream u sent nothing for 300s mid-stream", "stalled"),
        ("upstream u is unreachable: refused", "unreachable"),
        ("upstream error mid-stream: oops", "stream_failed"),
    ]:
        assert upstream_error_kind(record(status="error", error=error)) == kind


def test_the_per_call_metrics_update_is_cheap():
    """One call's update (record + added latency) costs microseconds, not milliseconds: counted
    at call end, never per chunk. The figure in docs/metrics.md comes from this timing."""
    m = ProxyMetrics(ControlState(), SimpleNamespace(open={}), SimpleNamespace(store=None))
    r = record()
    call = SimpleNamespace(record=r, upstream_sent_at=r.started_at, upstream_first_at=r.started_at)
    n = 20_000
    per_call = min(timeit.repeat(lambda: (m.record(r), m.added_latency(call)), number=n, repeat=3))
    assert per_call / n < 200e-6  # well under a millisecond even on a loaded 2-core machine


def test_top_median_interpolates_buckets_like_prometheus():
    s = Scrape("u", 0.0)
    s.values["t_bucket"] = {
        (("le", "0.1"),): 0.0,
        (("le", "0.2"),): 10.0,
        (("le", "0.4"),): 20.0,
        (("le", "+Inf"),): 20.0,
    }
    assert quantile(s, "t") == pytest.approx(0.2)  # rank 10: the top of the 0.1-0.2 bucket
    assert quantile(s, "t", 0.75) == pytest.approx(0.3)
    assert quantile(Scrape("u", 0.0), "t") is None
