"""`polar-mitm top --control URL [URL ...]`: a live terminal view of running proxies.

Each URL is a proxy's control port (`polar_control_listen`); its ``/metrics`` (metrics.py) is
scraped every ``--interval`` seconds and parsed with prometheus_client's own parser, so `top`
shows exactly what a Prometheus server would store. Rates (calls/s, tokens/s) are the difference
between two scrapes; time to first byte and added latency are the median of the histograms'
buckets since the proxy started (as Prometheus' ``histogram_quantile`` interpolates them).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import click
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live

from ..control_client import control_token
from .listing import Column, Listing, emit, terminal_width

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Scrape:
    """One proxy's metrics at one moment: sample name -> {labels: value}."""

    url: str
    at: float
    values: dict[str, dict[Labels, float]] = field(default_factory=dict)
    error: str | None = None

    def total(self, name: str, **match: str) -> float:
        return sum(
            v
            for labels, v in self.values.get(name, {}).items()
            if all(dict(labels).get(k) == want for k, want in match.items())
        )

    def by(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for labels, v in self.values.get(name, {}).items():
            d = dict(labels)
            key = tuple(d.get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + v
        return out


def fail(message: str) -> None:
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(1)


def bad_url(url: str) -> str | None:
    """Why `url` is not an http(s)://HOST[:PORT] URL (None when it is one)."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return f"{url!r} has a bad port"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http://HOST:PORT URL (a proxy's control port)"
    return None


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def scrape(url: str, token: str | None, timeout: float = 5.0) -> Scrape:
    """GET ``url``/metrics and parse it; an unreachable or refusing proxy gives ``error``."""
    out = Scrape(url, time.monotonic())
    request = urllib.request.Request(metrics_url(url))
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        hint = " (set POLAR_CONTROL_TOKEN or give --token-file)" if e.code in (401, 403) else ""
        out.error = f"HTTP {e.code}{hint}"
        return out
    except (OSError, ValueError) as e:
        out.error = f"unreachable: {getattr(e, 'reason', e)}"
        return out
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.values.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    except ValueError as e:
        out.error = f"not Prometheus metrics: {e}"
    return out


def quantile(s: Scrape, name: str, q: float = 0.5) -> float | None:
    """``histogram_quantile(q, ...)`` over every label set of histogram ``name``."""
    buckets: dict[float, float] = {}
    for labels, v in s.values.get(f"{name}_bucket", {}).items():
        le = float(dict(labels)["le"])
        buckets[le] = buckets.get(le, 0.0) + v
    if not buckets:
        return None
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in edges:
        count = buckets[upper]
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def _rate(now: Scrape, before: Scrape | None, name: str) -> str:
    if before is None or before.error or now.error or now.at <= before.at:
        return "-"
    return f"{(now.total(name) - before.total(name)) / (now.at - before.at):.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _n(x: float) -> str:
    return f"{x:.0f}"


PROXY_COLUMNS = (
    Column("proxy"),
    Column("state", wraps=True),
    Column("calls", numeric=True),
    Column("calls/s", numeric=True, drop=10),
    Column("in flight", numeric=True, drop=9),
    Column("waiting", numeric=True, drop=7),
    Column("open rollouts", numeric=True, drop=8),
    Column("sampled", numeric=True, drop=4),
    Column("tok/s", numeric=True, drop=5),
    Column("ttfb p50 ms", numeric=True, drop=11),
    Column("added p50 ms", numeric=True, drop=3),
    Column("flags", numeric=True, drop=12),
    Column("upstream err", numeric=True, drop=13),
    Column("journal lag", numeric=True, drop=2),
    Column("shards", numeric=True, drop=1),
)
CALL_COLUMNS = (
    Column("proxy", drop=2),
    Column("dialect"),
    Column("harness"),
    Column("route", drop=1),
    Column("status"),
    Column("calls", numeric=True),
)


def listings(now: Sequence[Scrape], before: dict[str, Scrape]) -> list[Listing]:
    """The proxies (one row each) and the calls by dialect / harness / route / status."""
    proxies = Listing("polar-mitm top", PROXY_COLUMNS)
    calls = Listing("calls", CALL_COLUMNS)
    for s in now:
        if s.error:
            proxies.add(s.url, s.error, *["-"] * (len(PROXY_COLUMNS) - 2))
            continue
        prev = before.get(s.url)
        proxies.add(
            s.url,
            "paused" if s.total("polar_paused") else "up",
            _n(s.total("polar_calls_total")),
            _rate(s, prev, "polar_calls_total"),
            _n(s.total("polar_calls_in_flight")),
            _n(s.total("polar_calls_waiting")),
            _n(s.total("polar_rollouts_open")),
            _n(s.total("polar_tokens_sampled_total")),
            _rate(s, prev, "polar_tokens_sampled_total"),
            _ms(quantile(s, "polar_time_to_first_byte_seconds")),
            _ms(quantile(s, "polar_added_latency_seconds")),
            _n(s.total("polar_fidelity_flags_total")),
            _n(s.total("polar_upstream_errors_total")),
            _n(s.total("polar_journal_lag_records")),
            _n(s.total("polar_shard_flushes_total")),
        )
        by = s.by("polar_calls_total", "dialect", "harness", "route", "status")
        for (dialect, harness, route, status), n in sorted(by.items()):
            calls.add(s.url, dialect, harness, route, status, _n(n))
    return [proxies, calls]


def render(now: Sequence[Scrape], before: dict[str, Scrape], console: Console) -> RenderableType:
    """The listings fitted to the console (`cli/listing.py`: urls and figures never cut)."""
    width = terminal_width(console)
    return Group(*(listing.table(width, console)[0] for listing in listings(now, before)))


@click.command("top")
@click.option(
    "--control",
    "controls",
    multiple=True,
    metavar="URL",
    help="A proxy's control port (polar_control_listen), e.g. http://10.0.0.5:8099; repeat, "
    "or list several after one --control.",
)
@click.argument("more", nargs=-1, metavar="[URL...]")
@click.option("--proxy", "old_proxy", multiple=True, hidden=True)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A file holding the control token (default: $POLAR_CONTROL_TOKEN, else the file "
    "$POLAR_CONTROL_TOKEN_FILE names); not needed with polar_metrics_public.",
)
@click.option(
    "--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds."
)
@click.option(
    "--once",
    is_flag=True,
    help="Print one frame and exit (for scripts and pipes); exit 1 when a proxy is unreachable.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="With --once: JSON lines, one object per proxy and per call kind (the frame's figures).",
)
def top(
    controls: tuple[str, ...],
    more: tuple[str, ...],
    old_proxy: tuple[str, ...],
    token_file: str | None,
    interval: float,
    once: bool,
    as_json: bool,
) -> None:
    """A live view of running proxies: calls, rates, tokens, latency, fidelity flags, journal
    lag, from each one's Prometheus /metrics. Ctrl-C quits."""
    if old_proxy:
        # `--proxy` names the proxy's own port everywhere else (env, status, end): here it meant
        # the control port, so it is refused rather than read two ways
        fail("top reads a control port: give --control URL (polar_control_listen), not --proxy")
    urls = list(dict.fromkeys([*controls, *more]))
    if not urls:
        fail("give --control URL: a proxy's control port (polar_control_listen)")
    for url in urls:
        problem = bad_url(url)
        if problem:
            fail(problem)
    try:
        token = control_token(token_file) or None
    except ValueError as e:
        fail(str(e))
    console = Console()
    before: dict[str, Scrape] = {}
    if as_json and not once:
        fail("--json needs --once (a live view is for a terminal)")
    if once:
        frame = [scrape(u, token) for u in urls]
        if as_json:
            for listing in listings(frame, before):
                names = [c.name for c in listing.columns]
                for row in listing.rows:
                    click.echo(
                        json.dumps({"listing": listing.title, **dict(zip(names, row, strict=True))})
                    )
        else:
            emit(listings(frame, before), console=console)
        down = [s for s in frame if s.error]
        if down:
            fail("; ".join(f"{s.url}: {s.error}" for s in down))
        return
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                now = [scrape(u, token) for u in urls]
                live.update(render(now, before, console), refresh=True)
                before = {s.url: s for s in now if not s.error}
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
