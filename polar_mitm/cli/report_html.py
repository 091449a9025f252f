"""`polar-mitm report --html`: one self-contained page for people who would rather look than read.

No network, no libraries: inline CSS, SVG drawn here, and a few lines of JS (a filter box). Per
rollout: tokens per call (prompt and sampled), the mask spans of each trace (environment vs policy
tokens, call boundaries), latency per call (time to first byte and the rest, failed calls in red)
and the fidelity flags / untrainable reasons. SVG ``<title>`` elements are the tooltips.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Sequence
from typing import Any

from ..trajectory.traceview import mask_runs
from .summary import RolloutSummary, Summary

ENV = "#17a2b8"  # environment tokens (mask 0), the cyan of `show`
POLICY = "#2e9e44"  # policy tokens (mask 1), its green
PROMPT = "#b8dfe6"
ERROR = "#d9534f"
TTFB = "#f0ad4e"
REST = "#5c6bc0"

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:16px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#b0bec5}main{padding:16px 24px;max-width:1200px}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0 16px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:110px}
.card b{display:block;font-size:18px}.card span{color:#666;font-size:12px}
table{border-collapse:collapse;background:#fff;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}td.n{text-align:right}
section.rollout{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 16px;margin:16px 0}
section.rollout h2{font-size:16px;margin:8px 0}h3{font-size:13px;margin:12px 0 4px;color:#455a64}
.badge{display:inline-block;border-radius:3px;padding:0 6px;margin:0 4px 2px 0;font-size:12px;background:#eceff1}
.bad{background:#f8d7da;color:#721c24}.good{background:#d4edda;color:#155724}.flag{background:#fff3cd;color:#856404}
.legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}
#filter{padding:4px 8px;width:320px}.muted{color:#888}svg{display:block}
"""

JS = """
(function () {
  var box = document.getElementById('filter');
  var sections = Array.prototype.slice.call(document.querySelectorAll('section.rollout'));
  var count = document.getElementById('shown');
  function apply() {
    var q = box.value.toLowerCase();
    var shown = 0;
    sections.forEach(function (s) {
      var hit = !q || s.getAttribute('data-search').indexOf(q) !== -1;
      s.style.display = hit ? '' : 'none';
      if (hit) { shown += 1; }
    });
    count.textContent = shown + ' of ' + sections.length + ' rollouts shown';
  }
  box.addEventListener('input', apply);
  apply();
})();
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _bar_chart(
    bars: Sequence[Sequence[tuple[float, str, str]]], labels: Sequence[str], unit: str
) -> str:
    """Vertical stacked bars: one list of (value, colour, tooltip) per bar."""
    if not bars:
        return '<p class="muted">no calls</p>'
    top = max((sum(v for v, _, _ in b) for b in bars), default=0) or 1
    width, height, left, bottom = 760, 150, 52, 20
    step = (width - left) / len(bars)
    bw = max(1.0, min(28.0, step * 0.75))
    out = [f'<svg width="{width}" height="{height + bottom}" role="img"><title>{_e(unit)}</title>']
    for frac in (0, 0.5, 1):
        y = height - frac * (height - 10)
        out.append(
            f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">'
            f"{_e(_fmt(top * frac))}</text>"
        )
    for i, bar in enumerate(bars):
        x = left + i * step + (step - bw) / 2
        y = height
        for value, colour, tip in bar:
            h = value / top * (height - 10)
            y -= h
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{max(h, 0):.1f}" '
                f'fill="{colour}"><title>{_e(tip)}</title></rect>'
            )
        if len(bars) <= 40 or i % max(1, len(bars) // 20) == 0:
            out.append(
                f'<text x="{x + bw / 2:.1f}" y="{height + 14}" font-size="10" '
                f'text-anchor="middle">{_e(labels[i])}</text>'
            )
    out.append("</svg>")
    return "".join(out)


def tokens_chart(calls: Sequence[dict[str, Any]]) -> str:
    bars = [
        [
            (
                c["prompt_tokens"],
                PROMPT,
                f"call {i + 1} {c['call_id']}: prompt {c['prompt_tokens']} tokens",
            ),
            (
                c["output_tokens"],
                POLICY,
                f"call {i + 1} {c['call_id']}: sampled {c['output_tokens']} tokens",
            ),
        ]
        for i, c in enumerate(calls)
    ]
    return _bar_chart(bars, [str(i + 1) for i in range(len(calls))], "tokens per call")


def latency_chart(calls: Sequence[dict[str, Any]]) -> str:
    bars = []
    for i, c in enumerate(calls):
        total = c["latency_ms"] or 0.0
        first = min(c["ttfb_ms"] or 0.0, total)
        failed = c["status"] != "completed"
        tip = (
            f"call {i + 1} {c['call_id']}: {total:.0f} ms, first byte {first:.0f} ms, {c['status']}"
        )
        if c.get("error"):
            tip += f": {c['error']}"
        bars.append(
            [
                (first, ERROR if failed else TTFB, tip),
                (total - first, ERROR if failed else REST, tip),
            ]
        )
    return _bar_chart(bars, [str(i + 1) for i in range(len(calls))], "latency per call (ms)")


def mask_chart(traces: Sequence[dict[str, Any]]) -> str:
    """One strip per trace: environment / policy runs to scale, call boundaries as ticks."""
    if not traces:
        return (
            '<p class="muted">no traces (the rollout has not ended, or no call had token ids)</p>'
        )
    longest = max(len(t["loss_mask"]) for t in traces) or 1
    left, width, row = 190, 760, 26
    out = [f'<svg width="{width}" height="{row * len(traces) + 6}" role="img">']
    scale = (width - left - 4) / longest
    for k, t in enumerate(traces):
        y = 4 + k * row
        label = f"{t.get('role')} · {t.get('break_reason')} · {len(t['loss_mask'])} tok"
        out.append(
            f'<text x="0" y="{y + 14}" font-size="11"><title>{_e(t["trace_id"])}</title>{_e(label)}</text>'
        )
        for value, start, end in mask_runs(t["loss_mask"]):
            colour = POLICY if value else ENV
            kind = "policy (mask 1)" if value else "environment (mask 0)"
            out.append(
                f'<rect x="{left + start * scale:.2f}" y="{y}" width="{max((end - start) * scale, 0.5):.2f}" '
                f'height="18" fill="{colour}"><title>{_e(kind)}: tokens {start}-{end - 1} '
                f"({end - start})</title></rect>"
            )
        for off in (t.get("call_offsets") or [])[1:]:
            x = left + off * scale
            out.append(
                f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{y - 2}" y2="{y + 20}" stroke="#263238"/>'
            )
    out.append("</svg>")
    return "".join(out)


def _flags(
    r: RolloutSummary, calls: Sequence[dict[str, Any]], traces: Sequence[dict[str, Any]]
) -> str:
    parts = []
    for c in calls:
        for flag in c["fidelity_flags"]:
            parts.append(f'<span class="badge flag" title="{_e(c["call_id"])}">⚑ {_e(flag)}</span>')
    for t in traces:
        if not t.get("trainable"):
            parts.append(
                f'<span class="badge bad" title="{_e(t["trace_id"])}">untrainable: '
                f"{_e(t.get('untrainable_reason'))}</span>"
            )
    unchecked = '<span class="badge">fidelity not checked</span>'
    if r.calls and not r.fidelity_checked:  # no check ran: absence of flags says nothing
        if not parts and r.traces:
            return unchecked + '<span class="badge good">every trace trainable</span>'
        return unchecked + "".join(parts)
    if not parts:
        return (
            '<span class="badge good">no fidelity flags, every trace trainable</span>'
            if r.traces
            else ""
        )
    return "".join(parts)


def _section(
    r: RolloutSummary, calls: Sequence[dict[str, Any]], traces: Sequence[dict[str, Any]]
) -> str:
    search = " ".join(
        [r.rollout_id, r.group_id or "", r.status or "open", *r.fidelity_flags, *r.untrainable]
    )
    state = r.status or "open"
    trainable = (
        '<span class="badge good">trainable</span>'
        if r.trainable
        else f'<span class="badge bad">not trainable {_e(", ".join(r.untrainable))}</span>'
        if r.traces
        else ""
    )
    head = (
        f'<h2>{_e(r.rollout_id)} <span class="badge">{_e(state)}</span>'
        f'<span class="badge">reward {_e(_fmt(r.reward))}</span>{trainable}</h2>'
        f"<p>group {_e(r.group_id or '-')} · {r.calls} calls ({r.errors} not completed) · "
        f"{r.traces} traces · {r.prompt_tokens} prompt / {r.output_tokens} sampled tokens · "
        f"{r.policy_tokens} policy / {r.env_tokens} environment tokens in traces</p>"
    )
    return (
        f'<section class="rollout" id="{_e("r-" + r.rollout_id)}" data-search="{_e(search.lower())}">'
        f'{head}<h3>tokens per call <span class="legend"><i style="background:{PROMPT}"></i>prompt'
        f'<i style="background:{POLICY}"></i>sampled</span></h3>{tokens_chart(calls)}'
        f'<h3>mask spans per trace <span class="legend"><i style="background:{ENV}"></i>environment'
        f'<i style="background:{POLICY}"></i>policy</span></h3>{mask_chart(traces)}'
        f'<h3>latency per call (ms) <span class="legend"><i style="background:{TTFB}"></i>to first '
        f'byte<i style="background:{REST}"></i>the rest<i style="background:{ERROR}"></i>not '
        f"completed</span></h3>{latency_chart(calls)}"
        f"<h3>fidelity</h3><div>{_flags(r, calls, traces)}</div></section>"
    )


def render(
    source: str,
    summary: Summary,
    calls: Sequence[dict[str, Any]],
    traces: Sequence[dict[str, Any]],
    max_rollouts: int | None = None,
) -> str:
    """The page. ``calls``: `summary.call_rows`; ``traces``: trace rows with ``loss_mask``."""
    t = summary.totals
    cards = [
        ("rollouts", t["rollouts"]),
        ("GRPO groups", t["groups"]),
        ("calls", t["calls"]),
        ("not completed", t["errors"]),
        ("traces", t["traces"]),
        ("prompt tokens", t["prompt_tokens"]),
        ("sampled tokens", t["output_tokens"]),
        ("policy tokens", t["policy_tokens"]),
        ("environment tokens", t["env_tokens"]),
        (
            "flagged calls",
            sum(t["fidelity_flags"].values()) if t["fidelity_checked"] else "not checked",
        ),
        ("fidelity-checked calls", t["fidelity_checked"]),
    ]
    by_rollout_calls: dict[str, list[dict[str, Any]]] = {}
    for c in calls:
        by_rollout_calls.setdefault(c["rollout_id"], []).append(c)
    by_rollout_traces: dict[str, list[dict[str, Any]]] = {}
    for tr in traces:
        by_rollout_traces.setdefault(tr["rollout_id"], []).append(tr)
    rollouts = summary.rollouts[:max_rollouts] if max_rollouts else summary.rollouts
    groups = "".join(
        f"<tr><td>{_e(g.group_id)}</td><td class=n>{len(g.rollouts)}</td><td class=n>{g.rewarded}</td>"
        f"<td class=n>{_e(_fmt(g.reward_mean))}</td><td class=n>{_e(_fmt(g.reward_std))}</td>"
        f"<td class=n>{_e(_fmt(g.reward_min))}</td><td class=n>{_e(_fmt(g.reward_max))}</td>"
        f"<td class=n>{g.trainable_rollouts}</td><td class=n>{g.policy_tokens}</td></tr>"
        for g in summary.groups
    )
    index = "".join(
        f'<tr><td><a href="#{_e("r-" + r.rollout_id)}">{_e(r.rollout_id)}</a></td>'
        f"<td>{_e(r.group_id or '-')}</td><td>{_e(r.status or 'open')}</td>"
        f"<td class=n>{_e(_fmt(r.reward))}</td><td class=n>{r.calls}</td><td class=n>{r.traces}</td>"
        f"<td class=n>{r.output_tokens}</td><td>{'yes' if r.trainable else 'no'}</td></tr>"
        for r in rollouts
    )
    more = (
        f'<p class="muted">showing the first {len(rollouts)} of {len(summary.rollouts)} rollouts '
        "(--max-rollouts)</p>"
        if len(rollouts) < len(summary.rollouts)
        else ""
    )
    sections = "".join(
        _section(r, by_rollout_calls.get(r.rollout_id, []), by_rollout_traces.get(r.rollout_id, []))
        for r in rollouts
    )
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>polar-mitm report: {_e(source)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{CSS}</style></head><body>"
        f"<header><h1>polar-mitm capture report</h1><p>{_e(source)} · generated {now}</p></header><main>"
        '<div class="cards">'
        + "".join(f'<div class="card"><b>{_e(v)}</b><span>{_e(k)}</span></div>' for k, v in cards)
        + "</div>"
        + (
            "<h3>GRPO groups</h3><table><tr><th>group</th><th>rollouts</th><th>rewarded</th>"
            "<th>mean</th><th>std</th><th>min</th><th>max</th><th>trainable</th><th>policy tokens</th></tr>"
            f"{groups}</table>"
            if groups
            else ""
        )
        + "<h3>rollouts</h3><table><tr><th>rollout</th><th>group</th><th>status</th><th>reward</th>"
        f"<th>calls</th><th>traces</th><th>sampled</th><th>trainable</th></tr>{index}</table>{more}"
        '<p><input id="filter" type="search" placeholder="filter rollouts (id, group, status, flag)"> '
        '<span id="shown" class="muted"></span></p>'
        f"{sections}</main><script>{JS}</script></body></html>"
    )
