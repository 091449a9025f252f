"""`polar-mitm show`: one trace as a person reads it.

Decoded tokens in two colours — environment tokens (``loss_mask`` 0: prompts, tool output, the
chat template) in `ENV_STYLE`, policy tokens (1: what the model sampled, what training updates) in
`POLICY_STYLE` — with a rule at every call boundary (``call_offsets``) saying how many tokens that
call added and sampled, and a header with the trace's role, break reason and its evidence.
``ids`` shows each token's id after it; ``logprobs`` shades policy tokens by how unlikely the
policy found them. Pure rendering: `render` returns rich renderables, the CLI prints them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from ..core.record_facts import checked_with_tokenizer
from ..trajectory.traceview import Segment, segments
from . import chaintree

ENV_STYLE = Style(color="cyan")
POLICY_STYLE = Style(color="green", bold=True)
ID_STYLE = Style(dim=True)
# Without colours (piped, a file, a CI log) the policy tokens of each call are enclosed in these,
# so the one thing `show` is for, which tokens the policy sampled, survives `| less` and `| grep`.
POLICY_OPEN, POLICY_CLOSE = "⟪", "⟫"
# below this probability a policy token gets a red background, stronger the less likely it was
SHADE_BELOW = 0.9


def shade(logprob: float) -> Style:
    """The background for a policy token of this logprob (none when it was likely)."""
    p = math.exp(logprob) if logprob < 0 else 1.0
    if p >= SHADE_BELOW:
        return Style()
    level = (SHADE_BELOW - p) / SHADE_BELOW  # 0 (just below) .. 1 (impossible)
    return Style(bgcolor=f"rgb({90 + int(150 * level)},0,0)")


def visible(piece: str) -> str:
    """Control characters other than newline and tab shown as escapes (they would move the
    cursor or vanish in a terminal)."""
    if piece.isprintable() or all(ch.isprintable() or ch in "\n\t" for ch in piece):
        return piece
    return "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in piece)


def token_text(
    trace: dict[str, Any],
    seg: Segment,
    pieces: Sequence[str] | None,
    *,
    ids: bool = False,
    logprobs: bool = False,
    marks: bool = False,
) -> Text:
    """The tokens of one call: its environment tokens, then its sampled ones, styled by mask
    (and, with ``marks``, the sampled ones between `POLICY_OPEN` and `POLICY_CLOSE`)."""
    input_ids, lps = trace["input_ids"], trace["logprobs"]
    text = Text()
    for i in range(seg.start, seg.end):
        policy = i >= seg.gen_start
        if marks and i == seg.gen_start:
            text.append(POLICY_OPEN, POLICY_STYLE)
        style = POLICY_STYLE if policy else ENV_STYLE
        if policy and logprobs:
            style = style + shade(lps[i])
        if pieces is None:
            text.append(f"{input_ids[i]} ", style)
            continue
        text.append(visible(pieces[i]), style)
        if ids:
            text.append(f"[{input_ids[i]}]", style + ID_STYLE)
    if marks and seg.gen_start < seg.end:
        text.append(POLICY_CLOSE, POLICY_STYLE)
    return text


def _short(value: Any, width: int = 90) -> str:
    s = str(value)
    return s if len(s) <= width else s[: width - 1] + "…"


def fidelity_line(trace: dict[str, Any], calls: dict[str, dict[str, Any]]) -> str:
    """What the proxy's fidelity checks said about this trace, or "not checked" when none ran
    with the policy tokenizer on its calls: a trace without flags is only clean if checked."""
    ids = trace.get("call_ids") or []
    checked = sum(checked_with_tokenizer(calls.get(i, {}).get("fidelity_json")) for i in ids)
    if not checked:
        return "not checked (the proxy had no polar_tokenizer, or polar_fidelity=off)"
    try:
        data = json.loads(trace.get("fidelity_json") or "null")
    except ValueError:
        data = None
    data = data if isinstance(data, dict) else {}
    flags = data.get("flags") or {f: [] for f in trace.get("fidelity_flags") or ()}
    found = [f"⚑ {f}" + (f" ({len(i)} call(s))" if i else "") for f, i in flags.items()]
    # drift in this trace's turns is flagged on the later call that re-rendered them
    found += [
        f"⚑ {f} (seen by {len(i)} later call(s))"
        for f, i in (data.get("observed") or {}).items()
        if f not in flags
    ]
    wrong = data.get("policy_tokens_wrong") or 0
    return (
        f"checked {checked}/{len(ids)} calls: {', '.join(found) or 'no flags'}; {wrong} policy "
        "token(s) a retokenize-the-text pipeline would get wrong"
    )


def header(
    trace: dict[str, Any],
    others: Sequence[dict[str, Any]],
    tokenizer_note: str,
    calls: dict[str, dict[str, Any]] | None = None,
) -> RenderableType:
    """Who the trace is: rollout, role, break reason and evidence, sizes, reward, trainability;
    and the rollout's other traces (pick one with ``--trace``)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    n = len(trace["input_ids"])
    policy = sum(trace["loss_mask"])
    rows = [
        (
            "rollout",
            trace["rollout_id"]
            + (f"  (group {trace['group_id']})" if trace.get("group_id") else ""),
        ),
        ("trace", f"{trace['trace_id']}  revision {trace.get('revision')}"),
        ("role", trace.get("role") or "-"),
        ("break", trace.get("break_reason") or "-"),
    ]
    for key in ("purpose", "agent"):  # what started the chain, which agent's it is
        if trace.get(key) and trace[key] != "main":
            rows.append((key, trace[key]))
    if trace.get("parent_trace_id"):
        rows.append(
            (
                "parent",
                f"{trace['parent_trace_id']}  common prefix {trace.get('parent_prefix_len')} tokens",
            )
        )
    if trace.get("break_detail"):
        try:
            detail = json.loads(trace["break_detail"])
            rows.append(("evidence", _short(", ".join(f"{k}={v}" for k, v in detail.items()), 120)))
        except ValueError:
            rows.append(("evidence", _short(trace["break_detail"], 120)))
    rows += [
        (
            "tokens",
            f"{n} = {n - policy} environment + {policy} policy, {len(trace.get('call_ids') or [])} call(s)",
        ),
        ("status", f"{trace.get('status') or '-'}, reward {trace.get('reward')}"),
        (
            "trainable",
            "yes" if trace.get("trainable") else f"no: {trace.get('untrainable_reason')}",
        ),
    ]
    rows.append(("fidelity", fidelity_line(trace, calls or {})))
    legend = Text()
    legend.append("environment (mask 0)", ENV_STYLE)
    legend.append("  ")
    legend.append("policy (mask 1)", POLICY_STYLE)
    legend.append(f"   {tokenizer_note}", ID_STYLE)
    rows.append(("colours", legend))
    for name, value in rows:
        grid.add_row(name, value)
    parts: list[RenderableType] = [grid]
    if len(others) > 1:
        table = Table(
            title="traces of this rollout", title_justify="left", box=None, pad_edge=False
        )
        for col in ("", "trace", "role", "break", "calls", "tokens", "policy"):
            table.add_column(
                col, justify="right" if col in ("calls", "tokens", "policy") else "left"
            )
        for t in others:
            table.add_row(
                "▶" if t["trace_id"] == trace["trace_id"] else "",
                t["trace_id"],
                t.get("role") or "-",
                t.get("break_reason") or "-",
                str(len(t.get("call_ids") or [])),
                str(len(t.get("input_ids") or [])),
                str(t.get("num_policy_tokens")),
            )
        parts.append(table)
        parts.append(chaintree.tree(trace["rollout_id"], others, mark=trace["trace_id"]))
    return Group(*parts)


def call_rule(
    seg: Segment, count: int, call: dict[str, Any] | None, opens: str | None = None
) -> Rule:
    """The marker at a call boundary: which call, what it added, how it ended; ``opens`` for the
    first call: why this trace broke off from its parent."""
    words = [f"call {seg.index + 1}/{count}"]
    if opens:
        words.append(opens)
    if seg.call_id:
        words.append(seg.call_id)
    words.append(f"+{seg.env_tokens} env")
    words.append(f"{seg.sampled_tokens} sampled")
    if call:
        if call.get("finish_reason"):
            words.append(f"finish {call['finish_reason']}")
        if call.get("purpose") and call["purpose"] != "main":
            words.append(f"purpose {call['purpose']}")
        for flag in call.get("fidelity_flags") or ():
            words.append(f"⚑ {flag}")
    return Rule(" · ".join(words), style="bright_black", align="left")


def render(
    trace: dict[str, Any],
    others: Sequence[dict[str, Any]],
    pieces: Sequence[str] | None,
    calls: dict[str, dict[str, Any]],
    *,
    ids: bool = False,
    logprobs: bool = False,
    tokenizer_note: str = "",
    marks: bool = False,
) -> list[RenderableType]:
    segs = segments(trace)
    out: list[RenderableType] = [header(trace, others, tokenizer_note, calls)]
    if marks:
        out.append(
            Text(f"policy tokens (loss_mask 1) are between {POLICY_OPEN} and {POLICY_CLOSE}")
        )
    reason = trace.get("break_reason") or "-"
    opens = f"break {reason}"
    if trace.get("parent_trace_id"):
        opens += f" from {trace['parent_trace_id']} at token {trace.get('parent_prefix_len')}"
    for seg in segs:
        call = calls.get(seg.call_id or "")
        out.append(call_rule(seg, len(segs), call, opens if seg.index == 0 else None))
        out.append(token_text(trace, seg, pieces, ids=ids, logprobs=logprobs, marks=marks))
    out.append(
        Rule(f"end of trace {trace['trace_id']} ({reason})", style="bright_black", align="left")
    )
    return out
