"""A trace row read back as calls: where each call's environment and sampled tokens lie.

A trace's ``input_ids`` are its calls' new tokens in order; ``call_offsets[k]`` is where call k's
new tokens start, and within them the environment tokens (``loss_mask`` 0: the prompt tokens the
call added) come before the sampled ones (1). So call k's prompt is ``input_ids[:gen_start]`` and
its output ``input_ids[gen_start:end]`` — the per-turn view NeMo Gym wants, the segments `show`
marks and the report draws. Shared by `show`, `export` and `report_html`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Segment:
    index: int
    call_id: str | None
    start: int  # first new token of the call (environment tokens first)
    gen_start: int  # first sampled token
    end: int

    @property
    def env_tokens(self) -> int:
        return self.gen_start - self.start

    @property
    def sampled_tokens(self) -> int:
        return self.end - self.gen_start


class TraceShapeError(ValueError):
    """A trace row whose arrays disagree (never written by polar-mitm; a damaged or foreign row)."""


def segments(trace: dict[str, Any]) -> list[Segment]:
    ids = trace.get("input_ids") or []
    mask = trace.get("loss_mask") or []
    n = len(ids)
    if len(mask) != n or len(trace.get("logprobs") or []) != n:
        raise TraceShapeError(
            f"trace {trace.get('trace_id')}: input_ids, loss_mask and logprobs differ in length"
        )
    offsets = list(trace.get("call_offsets") or [0])
    call_ids = list(trace.get("call_ids") or [])
    if offsets != sorted(offsets) or (offsets and (offsets[0] != 0 or offsets[-1] > n)):
        raise TraceShapeError(f"trace {trace.get('trace_id')}: call_offsets out of order")
    out = []
    bounds = [*offsets, n]
    for k in range(len(offsets)):
        start, end = bounds[k], bounds[k + 1]
        gen = end
        while gen > start and mask[gen - 1] == 1:
            gen -= 1
        if any(mask[start:gen]):
            raise TraceShapeError(
                f"trace {trace.get('trace_id')}: call {k} has sampled tokens before its prompt ends"
            )
        out.append(Segment(k, call_ids[k] if k < len(call_ids) else None, start, gen, end))
    return out


def mask_runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: (value, start, end)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((int(mask[start]), start, i))
            start = i
    return runs


def main_trace(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trace a person means by "the rollout": the main agent's root chain (role main, no
    parent), the latest written if the rollout id was reused; else the main chain with the most
    policy tokens; else the one with the most tokens."""

    def key(t: dict[str, Any]) -> tuple:
        return (t.get("num_policy_tokens") or 0, len(t.get("input_ids") or ()))

    roots = [t for t in traces if t.get("role") == "main" and not t.get("parent_trace_id")]
    if roots:
        return max(roots, key=lambda t: (t.get("created_at") is not None, t.get("created_at")))
    mains = [t for t in traces if t.get("role") == "main"]
    return max(mains or traces, key=key)


def pick_trace(traces: Sequence[dict[str, Any]], wanted: str | None) -> dict[str, Any]:
    """``wanted``: a trace id or a unique prefix of one; None: `main_trace`. Raises LookupError."""
    if not traces:
        raise LookupError("no traces")
    if wanted is None:
        return main_trace(traces)
    exact = [t for t in traces if t["trace_id"] == wanted]
    hits = exact or [t for t in traces if t["trace_id"].startswith(wanted)]
    if len(hits) == 1:
        return hits[0]
    ids = ", ".join(t["trace_id"] for t in traces)
    what = "matches several traces" if hits else "is not a trace of this rollout"
    raise LookupError(f"--trace {wanted} {what} (its traces: {ids})")
