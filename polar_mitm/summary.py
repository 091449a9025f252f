"""Figures about captured data, computed from the shards (pure functions, used by the CLI)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(slots=True)
class RolloutSummary:
    rollout_id: str
    group_id: str | None
    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    retokenized: int = 0  # calls whose ids the proxy recomputed (the server returned none)
    statuses: dict[str, int] = field(default_factory=dict)
    dialects: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_calls(calls: pa.Table) -> list[RolloutSummary]:
    """One summary per rollout, in order of first call."""
    if calls.num_rows == 0:
        return []
    prompt_len = pc.fill_null(pc.list_value_length(calls["prompt_token_ids"]), 0).to_pylist()
    output_len = pc.fill_null(pc.list_value_length(calls["output_token_ids"]), 0).to_pylist()
    order = pc.sort_indices(calls, [("started_at", "ascending")]).to_pylist()
    rollouts = calls["rollout_id"].to_pylist()
    groups = calls["group_id"].to_pylist()
    statuses = calls["status"].to_pylist()
    dialects = calls["dialect"].to_pylist()
    sources = calls["ids_source"].to_pylist() if "ids_source" in calls.column_names else []
    out: dict[str, RolloutSummary] = {}
    for i in order:
        s = out.get(rollouts[i])
        if s is None:
            s = out[rollouts[i]] = RolloutSummary(rollouts[i], groups[i])
        s.calls += 1
        s.prompt_tokens += prompt_len[i]
        s.output_tokens += output_len[i]
        status = statuses[i] or "unknown"
        s.statuses[status] = s.statuses.get(status, 0) + 1
        if status != "completed":
            s.errors += 1
        if sources and sources[i] == "retokenized":
            s.retokenized += 1
        if dialects[i] and dialects[i] not in s.dialects:
            s.dialects.append(dialects[i])
    return list(out.values())
