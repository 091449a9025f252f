"""The listings `polar-mitm summary` and `polar-mitm calls` print (figures from `summary`);
`cli/listing.py` fits them to a terminal, a pipe or ``--plain``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .listing import Column, Listing
from .summary import RolloutSummary, Summary


def _counts(d: dict[str, int]) -> str:
    return ", ".join(k if n == 1 else f"{k}×{n}" for k, n in d.items()) or "-"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def fidelity_cell(flags: dict[str, int], checked: int) -> str:
    """The flags of some calls, or "none" when they were checked and carry none; "not checked"
    when no check ran (no polar_tokenizer, polar_fidelity=off): never "no flags" then."""
    if flags:
        return _counts(flags)
    return "none" if checked else "not checked"


# name, numeric, wraps, drop order on a narrow terminal (1 first; 0 never)
ROLLOUT_COLUMNS = (
    Column("rollout"),
    Column("group", drop=3),
    Column("calls", numeric=True),
    Column("err", numeric=True, drop=9),
    Column("prompt", numeric=True, drop=4),
    Column("sampled", numeric=True, drop=8),
    Column("grammar", numeric=True, drop=1),  # sampled under a grammar (docs/constrained.md)
    Column("traces", numeric=True, drop=2),
    Column("policy", numeric=True, drop=7),
    Column("env", numeric=True, drop=1),
    Column("breaks", wraps=True, drop=5),
    Column("flags", wraps=True, drop=6),
    Column("status", drop=10),
    Column("reward", numeric=True, drop=11),
    Column("trainable", wraps=True, drop=12),
)
GROUP_COLUMNS = (
    Column("group"),
    Column("rollouts", numeric=True),
    Column("calls", numeric=True, drop=2),
    Column("traces", numeric=True, drop=1),
    Column("sampled", numeric=True, drop=3),
    Column("rewarded", numeric=True, drop=4),
    Column("mean", numeric=True),
    Column("std", numeric=True),
    Column("min", numeric=True, drop=5),
    Column("max", numeric=True, drop=6),
    Column("trainable", drop=7),
    Column("status", wraps=True, drop=8),
)


def _rollout_cells(r: RolloutSummary) -> list[object]:
    trainable = "yes" if r.trainable else ("no: " + ", ".join(r.untrainable) if r.traces else "-")
    return [
        r.rollout_id,
        r.group_id or "-",
        r.calls,
        r.errors,
        r.prompt_tokens,
        r.output_tokens,
        r.constrained_tokens,
        r.traces,
        r.policy_tokens,
        r.env_tokens,
        _counts(r.break_reasons),
        fidelity_cell(r.fidelity_flags, r.fidelity_checked) if r.calls else "-",
        r.status or "open",
        _num(r.reward),
        trainable,
    ]


def totals_line(summary: Summary) -> str:
    """The totals in one line, printed last: with hundreds of rollouts the table's totals row
    sits far above the groups and the chain trees printed after it."""
    t = summary.totals
    return (
        f"total: {t['rollouts']} rollout(s) in {t['groups']} group(s), {t['calls']} call(s) "
        f"({t['errors']} errors), {t['traces']} trace(s) ({t['trainable_traces']} trainable), "
        f"{t['policy_tokens']} policy / {t['env_tokens']} environment tokens, "
        f"{t['rewarded']} rewarded"
    )


def rollout_listing(summary: Summary, source: str) -> Listing:
    """Rollouts, with a totals row."""
    listing = Listing(f"polar-mitm capture: {source}", ROLLOUT_COLUMNS)
    for r in summary.rollouts:
        listing.add(*_rollout_cells(r))
    t = summary.totals
    total = [
        f"total ({t['rollouts']})",
        t["groups"],
        t["calls"],
        t["errors"],
        t["prompt_tokens"],
        t["output_tokens"],
        t["constrained_tokens"],
        t["traces"],
        t["policy_tokens"],
        t["env_tokens"],
        _counts(t["break_reasons"]),
        fidelity_cell(t["fidelity_flags"], t["fidelity_checked"]),
        "",
        f"{t['rewarded']} rewarded",
        f"{t['trainable_traces']}/{t['traces']} traces",
    ]
    listing.totals.append([str(c) for c in total])
    return listing


def group_listing(summary: Summary) -> Listing:
    """GRPO groups: rewards and how many rollouts are trainable."""
    listing = Listing("GRPO groups (reward std: population, as GRPO normalizes)", GROUP_COLUMNS)
    for g in summary.groups:
        listing.add(
            g.group_id,
            len(g.rollouts),
            g.calls,
            g.traces,
            g.output_tokens,
            g.rewarded,
            _num(g.reward_mean),
            _num(g.reward_std),
            _num(g.reward_min),
            _num(g.reward_max),
            f"{g.trainable_rollouts}/{len(g.rollouts)}",
            _counts(g.statuses),
        )
    return listing


def summary_listings(summary: Summary, source: str) -> list[Listing]:
    """Rollouts (with a totals row), then GRPO groups when there are any."""
    listings = [rollout_listing(summary, source)]
    if summary.groups:
        listings.append(group_listing(summary))
    return listings


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


CALL_COLUMNS = (
    Column("started", drop=5),
    Column("rollout"),
    Column("call"),
    Column("dialect", drop=10),
    Column("purpose", drop=3),
    Column("model", wraps=True, drop=2),
    Column("prompt", numeric=True, drop=9),
    Column("sampled", numeric=True, drop=12),
    Column("ms", numeric=True, drop=8),
    Column("ttfb", numeric=True, drop=6),
    Column("status", drop=11),
    Column("finish", drop=4),
    Column("flags", wraps=True, drop=7),
    Column("error", wraps=True, drop=1),
)


def calls_listing(rows: Sequence[dict[str, Any]], source: str) -> Listing:
    """One row per call, ids whole, with a totals row."""
    listing = Listing(f"calls: {source}", CALL_COLUMNS)
    for r in rows:
        model = r["model_requested"] or "-"
        if r["model_served"] and r["model_served"] != r["model_requested"]:
            model += f" → {r['model_served']}"
        status = r["status"] or "-"
        if r["http_status"] and r["http_status"] != 200:
            status += f" ({r['http_status']})"
        flags = {f: 1 for f in r["fidelity_flags"]}
        listing.add(
            (r["started_at"] or "-")[11:23],
            r["rollout_id"],
            r["call_id"],
            r["dialect"] or "-",
            r["purpose"] or "-",
            model,
            r["prompt_tokens"],
            r["output_tokens"],
            _ms(r["latency_ms"]),
            _ms(r["ttfb_ms"]),
            status,
            r["finish_reason"] or "-",
            fidelity_cell(flags, r["fidelity_checked"]),
            r["error"] or "",
        )
    total = ["", "total", str(len(rows)), "", "", ""]
    total += [
        str(sum(r["prompt_tokens"] for r in rows)),
        str(sum(r["output_tokens"] for r in rows)),
    ]
    total += ["", "", f"{sum(r['status'] != 'completed' for r in rows)} failed", "", "", ""]
    listing.totals.append(total)
    return listing


def anonymous_note(summary: Summary) -> str | None:
    """A line under the rollouts when some were named by their client address alone."""
    names = [r.rollout_id for r in summary.rollouts if r.anonymous]
    if not names:
        return None
    return (
        f"{len(names)} anonymous rollout(s) ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}):"
        " the calls named no rollout (no polar- key, proxy credentials, x-polar-rollout header or"
        " session id), so every session from the client address is one rollout; its traces are"
        " untrainable unless polar_train_allow=anonymous (one container per rollout). Give each"
        " rollout an id: `polar-mitm env --rollout ID` or the API key polar-ID."
    )
