"""The rich tables `polar-mitm summary` and `polar-mitm calls` print (figures from `summary`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table

from .summary import Summary

WIDE = {"error": 20, "breaks": 10, "rollout": 8}
NO_WRAP = ("call", "started")


def _counts(d: dict[str, int]) -> str:
    return ", ".join(k if n == 1 else f"{k}×{n}" for k, n in d.items()) or "-"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _table(title: str, columns: Sequence[str], numeric: Sequence[str]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        right = name in numeric
        table.add_column(
            name,
            justify="right" if right else "left",
            overflow="fold",
            no_wrap=name in NO_WRAP,
            min_width=WIDE.get(name),
        )
    return table


ROLLOUT_COLUMNS = (
    "rollout",
    "group",
    "calls",
    "err",
    "prompt",
    "sampled",
    "traces",
    "policy",
    "env",
    "breaks",
    "flags",
    "status",
    "reward",
    "trainable",
)
# what a terminal narrower than WIDE_TERMINAL gets (--json has every figure)
NARROW_COLUMNS = (
    "rollout",
    "calls",
    "err",
    "sampled",
    "policy",
    "breaks",
    "status",
    "reward",
    "trainable",
)
WIDE_TERMINAL = 150
NUMERIC = ("calls", "err", "prompt", "sampled", "traces", "policy", "env", "reward")


def summary_tables(summary: Summary, source: str, width: int = WIDE_TERMINAL) -> RenderableType:
    """Rollouts (with a totals row), then GRPO groups; fewer columns on a narrow terminal."""
    columns = ROLLOUT_COLUMNS if width >= WIDE_TERMINAL else NARROW_COLUMNS
    rollouts = _table(f"polar-mitm capture: {source}", columns, NUMERIC)
    for r in summary.rollouts:
        trainable = (
            "yes" if r.trainable else ("no: " + ", ".join(r.untrainable) if r.traces else "-")
        )
        row = {
            "rollout": r.rollout_id,
            "group": r.group_id or "-",
            "calls": r.calls,
            "err": r.errors,
            "prompt": r.prompt_tokens,
            "sampled": r.output_tokens,
            "traces": r.traces,
            "policy": r.policy_tokens,
            "env": r.env_tokens,
            "breaks": _counts(r.break_reasons),
            "flags": _counts(r.fidelity_flags),
            "status": r.status or "open",
            "reward": _num(r.reward),
            "trainable": trainable,
        }
        rollouts.add_row(*(str(row[c]) for c in columns))
    t = summary.totals
    rollouts.add_section()
    total = {
        "rollout": f"total ({t['rollouts']})",
        "group": str(t["groups"]),
        "calls": t["calls"],
        "err": t["errors"],
        "prompt": t["prompt_tokens"],
        "sampled": t["output_tokens"],
        "traces": t["traces"],
        "policy": t["policy_tokens"],
        "env": t["env_tokens"],
        "breaks": _counts(t["break_reasons"]),
        "flags": _counts(t["fidelity_flags"]),
        "status": "",
        "reward": f"{t['rewarded']} rewarded",
        "trainable": f"{t['trainable_traces']}/{t['traces']} traces",
    }
    rollouts.add_row(*(str(total[c]) for c in columns))
    parts: list[RenderableType] = [rollouts]
    if summary.groups:
        groups = _table(
            "GRPO groups (reward std: population, as GRPO normalizes)",
            (
                "group",
                "rollouts",
                "calls",
                "traces",
                "sampled",
                "rewarded",
                "mean",
                "std",
                "min",
                "max",
                "trainable",
                "status",
            ),
            ("rollouts", "calls", "traces", "sampled", "rewarded", "mean", "std", "min", "max"),
        )
        for g in summary.groups:
            groups.add_row(
                g.group_id,
                str(len(g.rollouts)),
                str(g.calls),
                str(g.traces),
                str(g.output_tokens),
                str(g.rewarded),
                _num(g.reward_mean),
                _num(g.reward_std),
                _num(g.reward_min),
                _num(g.reward_max),
                f"{g.trainable_rollouts}/{len(g.rollouts)}",
                _counts(g.statuses),
            )
        parts.append(groups)
    return Group(*parts)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def calls_table(rows: Sequence[dict[str, Any]], source: str) -> Table:
    """One row per call (ids shortened to 8 characters; --json has them whole)."""
    table = _table(
        f"calls: {source}",
        (
            "started",
            "rollout",
            "call",
            "dialect",
            "purpose",
            "model",
            "prompt",
            "sampled",
            "ms",
            "ttfb",
            "status",
            "finish",
            "flags",
            "error",
        ),
        ("prompt", "sampled", "ms", "ttfb"),
    )
    for r in rows:
        model = r["model_requested"] or "-"
        if r["model_served"] and r["model_served"] != r["model_requested"]:
            model += f" → {r['model_served']}"
        status = r["status"] or "-"
        if r["http_status"] and r["http_status"] != 200:
            status += f" ({r['http_status']})"
        table.add_row(
            (r["started_at"] or "-")[11:23],
            r["rollout_id"],
            r["call_id"][:8],
            r["dialect"] or "-",
            r["purpose"] or "-",
            model,
            str(r["prompt_tokens"]),
            str(r["output_tokens"]),
            _ms(r["latency_ms"]),
            _ms(r["ttfb_ms"]),
            status,
            r["finish_reason"] or "-",
            ", ".join(r["fidelity_flags"]) or "-",
            r["error"] or "",
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        str(len(rows)),
        "",
        "",
        "",
        str(sum(r["prompt_tokens"] for r in rows)),
        str(sum(r["output_tokens"] for r in rows)),
        "",
        "",
        f"{sum(r['status'] != 'completed' for r in rows)} failed",
        "",
        "",
        "",
    )
    return table
