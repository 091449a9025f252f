"""Figures about captured data, computed from the shards (pure functions, used by the CLI).

`summarize(calls, traces)` gives one `RolloutSummary` per rollout id, one `GroupSummary` per GRPO
group and the totals. Token counts come from the shards themselves: a call's prompt / sampled
tokens are the lengths of its id lists, a trace's policy / environment tokens its
``num_policy_tokens`` / ``num_env_tokens`` (the sums of its loss mask). `call_rows` is the calls
table. Tables may hold only the columns `captured.CALL_FIGURES` / `TRACE_FIGURES` name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.record_facts import CHECKED_WITH_TOKENIZER

ANONYMOUS = "client_address"  # the rollout_source of an id that is the client address alone


@dataclass(slots=True)
class RolloutSummary:
    rollout_id: str
    group_id: str | None
    sample_index: int | None = None
    calls: int = 0
    prompt_tokens: int = 0  # sum over calls of len(prompt_token_ids)
    output_tokens: int = 0  # sum over calls of len(output_token_ids): what the policy sampled
    # ... of them sampled under a grammar (calls' constrained_from on: docs/constrained.md)
    constrained_tokens: int = 0
    errors: int = 0  # calls that did not complete
    retokenized: int = 0  # calls whose ids the proxy recomputed (the server returned none)
    statuses: dict[str, int] = field(default_factory=dict)  # of the calls
    dialects: list[str] = field(default_factory=list)
    traces: int = 0
    policy_tokens: int = 0  # sum of the traces' loss masks
    env_tokens: int = 0
    roles: dict[str, int] = field(default_factory=dict)
    break_reasons: dict[str, int] = field(default_factory=dict)
    fidelity_flags: dict[str, int] = field(default_factory=dict)  # calls carrying each flag
    fidelity_checked: int = 0  # calls checked with a tokenizer (0: "not checked", not "no flags")
    status: str | None = None  # how the rollout ended (its traces' status); None: not ended yet
    reward: float | None = None  # the latest trace's reward
    trainable_traces: int = 0
    untrainable: list[str] = field(default_factory=list)  # reason kinds, e.g. "call_error"
    # which identity rule named the rollout (calls.rollout_source): client_address = anonymous
    rollout_sources: list[str] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.traces > 0 and self.trainable_traces == self.traces

    @property
    def anonymous(self) -> bool:
        """Named by its client address alone: every session from that address is this rollout."""
        return ANONYMOUS in self.rollout_sources

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["trainable"] = self.trainable
        d["anonymous"] = self.anonymous
        return d


@dataclass(slots=True)
class GroupSummary:
    group_id: str
    rollouts: list[str] = field(default_factory=list)
    calls: int = 0
    traces: int = 0
    output_tokens: int = 0
    policy_tokens: int = 0
    rewarded: int = 0  # rollouts with a reward
    reward_mean: float | None = None
    reward_std: float | None = None  # population std, as GRPO normalizes
    reward_min: float | None = None
    reward_max: float | None = None
    trainable_rollouts: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # of the rollouts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Summary:
    rollouts: list[RolloutSummary]
    groups: list[GroupSummary]
    totals: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "rollouts": [r.as_dict() for r in self.rollouts],
            "groups": [g.as_dict() for g in self.groups],
            "totals": self.totals,
        }


def _lengths(table: pa.Table, column: str) -> list[int]:
    if column not in table.column_names:
        return [0] * table.num_rows
    return pc.fill_null(pc.list_value_length(table[column]), 0).to_pylist()


def _col(table: pa.Table, column: str) -> list[Any]:
    if column not in table.column_names:
        return [None] * table.num_rows
    return table[column].to_pylist()


def _checked(table: pa.Table) -> list[bool]:
    """Per call: `checked_with_tokenizer`, computed by pyarrow over the column."""
    if "fidelity_json" not in table.column_names:
        return [False] * table.num_rows
    found = pc.match_substring_regex(table["fidelity_json"], CHECKED_WITH_TOKENIZER)
    return pc.fill_null(found, False).to_pylist()


def _count(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


def summarize_calls(calls: pa.Table) -> list[RolloutSummary]:
    """One summary per rollout, in order of first call, from calls/ alone."""
    return summarize(calls, None).rollouts


def summarize(calls: pa.Table, traces: pa.Table | None) -> Summary:
    out: dict[str, RolloutSummary] = {}
    _add_calls(out, calls)
    if traces is not None and traces.num_rows:
        _add_traces(out, traces)
    rollouts = list(out.values())
    groups = _groups(rollouts)
    return Summary(rollouts, groups, _totals(rollouts, groups))


def _add_calls(out: dict[str, RolloutSummary], calls: pa.Table) -> None:
    if calls.num_rows == 0:
        return
    prompt_len = _lengths(calls, "prompt_token_ids")
    output_len = _lengths(calls, "output_token_ids")
    order = pc.sort_indices(calls, [("started_at", "ascending")]).to_pylist()
    rollouts, groups = _col(calls, "rollout_id"), _col(calls, "group_id")
    samples, statuses = _col(calls, "sample_index"), _col(calls, "status")
    named_by = _col(calls, "rollout_source")
    dialects, sources = _col(calls, "dialect"), _col(calls, "ids_source")
    flags = _col(calls, "fidelity_flags")
    constrained = _col(calls, "constrained_from")
    checked = _checked(calls)
    for i in order:
        s = out.get(rollouts[i])
        if s is None:
            s = out[rollouts[i]] = RolloutSummary(rollouts[i], groups[i], samples[i])
        s.calls += 1
        s.prompt_tokens += prompt_len[i]
        s.output_tokens += output_len[i]
        if constrained[i] is not None:
            s.constrained_tokens += max(0, output_len[i] - constrained[i])
        status = statuses[i] or "unknown"
        _count(s.statuses, status)
        if status != "completed":
            s.errors += 1
        if sources[i] == "retokenized":
            s.retokenized += 1
        if dialects[i] and dialects[i] not in s.dialects:
            s.dialects.append(dialects[i])
        if named_by[i] and named_by[i] not in s.rollout_sources:
            s.rollout_sources.append(named_by[i])
        for flag in flags[i] or ():
            _count(s.fidelity_flags, flag)
        s.fidelity_checked += checked[i]


def _add_traces(out: dict[str, RolloutSummary], traces: pa.Table) -> None:
    cols = {
        c: _col(traces, c)
        for c in (
            "rollout_id",
            "group_id",
            "sample_index",
            "role",
            "break_reason",
            "num_policy_tokens",
            "num_env_tokens",
            "reward",
            "status",
            "trainable",
            "untrainable_reason",
            "created_at",
        )
    }
    latest: dict[str, Any] = {}
    statuses: dict[str, list[str]] = {}
    for i in range(traces.num_rows):
        rid = cols["rollout_id"][i]
        s = out.get(rid)
        if s is None:  # traces whose calls are not (or no longer) in calls/
            s = out[rid] = RolloutSummary(rid, cols["group_id"][i], cols["sample_index"][i])
        s.traces += 1
        s.policy_tokens += cols["num_policy_tokens"][i] or 0
        s.env_tokens += cols["num_env_tokens"][i] or 0
        _count(s.roles, cols["role"][i] or "unknown")
        _count(s.break_reasons, cols["break_reason"][i] or "unknown")
        status = cols["status"][i]
        if status and status not in statuses.setdefault(rid, []):
            statuses[rid].append(status)
        if cols["trainable"][i]:
            s.trainable_traces += 1
        for reason in (cols["untrainable_reason"][i] or "").split("; "):
            kind = reason.split(":", 1)[0].strip()
            if kind and kind not in s.untrainable:
                s.untrainable.append(kind)
        created = cols["created_at"][i]
        if cols["reward"][i] is not None and (rid not in latest or created >= latest[rid]):
            latest[rid] = created
            s.reward = cols["reward"][i]
    for rid, seen in statuses.items():
        out[rid].status = ",".join(seen)


def _groups(rollouts: list[RolloutSummary]) -> list[GroupSummary]:
    groups: dict[str, GroupSummary] = {}
    for r in rollouts:
        if r.group_id is None:
            continue
        g = groups.setdefault(r.group_id, GroupSummary(r.group_id))
        g.rollouts.append(r.rollout_id)
        g.calls += r.calls
        g.traces += r.traces
        g.output_tokens += r.output_tokens
        g.policy_tokens += r.policy_tokens
        g.trainable_rollouts += r.trainable
        _count(g.statuses, r.status or "open")
    for g in groups.values():
        rewards = [r.reward for r in rollouts if r.group_id == g.group_id and r.reward is not None]
        g.rewarded = len(rewards)
        if rewards:
            mean = sum(rewards) / len(rewards)
            g.reward_mean = mean
            g.reward_std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
            g.reward_min, g.reward_max = min(rewards), max(rewards)
    return list(groups.values())


def _totals(rollouts: list[RolloutSummary], groups: list[GroupSummary]) -> dict[str, Any]:
    totals: dict[str, Any] = {"rollouts": len(rollouts), "groups": len(groups)}
    for name in (
        "calls",
        "errors",
        "retokenized",
        "prompt_tokens",
        "output_tokens",
        "constrained_tokens",
        "traces",
        "policy_tokens",
        "env_tokens",
        "trainable_traces",
        "fidelity_checked",
    ):
        totals[name] = sum(getattr(r, name) for r in rollouts)
    totals["rewarded"] = sum(r.reward is not None for r in rollouts)
    totals["anonymous_rollouts"] = sum(r.anonymous for r in rollouts)
    for name in ("break_reasons", "fidelity_flags"):
        merged: dict[str, int] = {}
        for r in rollouts:
            for k, n in getattr(r, name).items():
                _count(merged, k, n)
        totals[name] = merged
    return totals


# -- the calls table ----------------------------------------------------------------------------


def _ms(later: Any, earlier: Any) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier).total_seconds() * 1000.0


def call_rows(calls: pa.Table) -> list[dict[str, Any]]:
    """One dict per call, in order of start: what `polar-mitm calls` shows."""
    if calls.num_rows == 0:
        return []
    calls = calls.take(pc.sort_indices(calls, [("started_at", "ascending")]))
    prompt_len = _lengths(calls, "prompt_token_ids")
    output_len = _lengths(calls, "output_token_ids")
    checked = _checked(calls)
    dropped = [
        c
        for c in ("prompt_token_ids", "output_token_ids", "fidelity_json")
        if c in calls.column_names
    ]
    out = []
    for i, c in enumerate(calls.drop_columns(dropped).to_pylist()):
        out.append(
            {
                "call_id": c["call_id"],
                "rollout_id": c["rollout_id"],
                "started_at": c["started_at"].isoformat() if c["started_at"] else None,
                "dialect": c.get("dialect"),
                "purpose": c.get("purpose"),
                "model_requested": c.get("model_requested"),
                "model_served": c.get("model_served"),
                "prompt_tokens": prompt_len[i],
                "output_tokens": output_len[i],
                "latency_ms": _ms(c.get("finished_at"), c.get("started_at")),
                "ttfb_ms": _ms(c.get("first_byte_at"), c.get("started_at")),
                "status": c.get("status"),
                "http_status": c.get("http_status"),
                "finish_reason": c.get("finish_reason"),
                "ids_source": c.get("ids_source"),
                "fidelity_flags": c.get("fidelity_flags") or [],
                "fidelity_checked": checked[i],
                "error": c.get("error"),
            }
        )
    return out
