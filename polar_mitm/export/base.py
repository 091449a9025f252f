"""What every export format shares: which traces go out, and each one's per-call view."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..tokens.tokenizer import PolicyTokenizer
from ..trajectory.traceview import Segment, segments


@dataclass(slots=True)
class ExportOptions:
    pad_id: int = 0  # verl: the id padding is filled with (attention_mask marks it anyway)
    tokenizer: PolicyTokenizer | None = None  # fills the text fields when given


@dataclass(slots=True)
class ExportResult:
    path: str
    format: str
    records: int
    rollouts: int
    policy_tokens: int
    without_reward: int
    roles: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExportFormat:
    name: str
    suffix: str
    summary: str  # one line for --help
    write: Callable[[list[Record], str, ExportOptions], dict[str, Any] | None]


def jsonl_format(
    name: str, summary: str, line: Callable[[Record, ExportOptions], dict[str, Any]]
) -> ExportFormat:
    """A format whose file is one JSON object per record, ``line(record, options)``: strict JSON
    (a NaN is an error, not a token no JSON reader takes), UTF-8 as is."""

    def write(records: list[Record], path: str, options: ExportOptions) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(line(r, options), ensure_ascii=False, allow_nan=False))
                f.write("\n")

    return ExportFormat(name=name, suffix=".jsonl", summary=summary, write=write)


@dataclass(slots=True)
class Record:
    """One trace to export with what the formats need around it."""

    trace: dict[str, Any]
    segments: list[Segment]
    calls: list[dict[str, Any] | None]  # the trace's calls in order (None: not in calls/)
    group_index: int  # GRPO group as an int (slime's group_index), in order of first appearance
    index: int  # position in the export

    @property
    def prompt_length(self) -> int:
        """Tokens before the first sampled one: the first call's prompt (trainers' "prompt")."""
        return self.segments[0].gen_start if self.segments else len(self.trace["input_ids"])

    @property
    def policy_tokens(self) -> int:
        return sum(self.trace["loss_mask"])

    @property
    def last_finish_reason(self) -> str | None:
        last = self.calls[-1] if self.calls else None
        return last.get("finish_reason") if last else None

    @property
    def model(self) -> str | None:
        for call in reversed(self.calls):
            if call and (call.get("model_served") or call.get("model_requested")):
                return call.get("model_served") or call.get("model_requested")
        return None

    def metadata(self) -> dict[str, Any]:
        """Where the record came from, for every format's free-form metadata field."""
        t = self.trace
        return {
            "source": "polar-mitm",
            "rollout_id": t["rollout_id"],
            "group_id": t.get("group_id"),
            "sample_index": t.get("sample_index"),
            "trace_id": t["trace_id"],
            "revision": t.get("revision"),
            "role": t.get("role"),
            "parent_trace_id": t.get("parent_trace_id"),
            "break_reason": t.get("break_reason"),
            "call_ids": list(t.get("call_ids") or []),
            "call_offsets": list(t.get("call_offsets") or []),
            "status": t.get("status"),
            "trainable": t.get("trainable"),
            "untrainable_reason": t.get("untrainable_reason"),
            "fidelity_flags": list(t.get("fidelity_flags") or []),
            "policy_versions": list(t.get("policy_versions") or []),
            # [start, end) pairs (flattened) of input_ids sampled under a grammar, whose
            # logprobs are not the policy's (docs/constrained.md)
            "constrained_spans": list(t.get("constrained_spans") or []),
        }


def left_out_reason(trace: dict[str, Any], include_all: bool, roles: Sequence[str]) -> str | None:
    """Why a trace is not exported (None: it is). Untrainable and unfinished traces only go out
    with ``include_all``; a role filter always applies."""
    if roles and (trace.get("role") or "") not in roles:
        return f"role {trace.get('role')}"
    if include_all:
        return None
    if not trace.get("trainable"):
        reason = (trace.get("untrainable_reason") or "untrainable").split(":", 1)[0]
        return f"untrainable ({reason})"
    if trace.get("status") != "completed":
        return f"status {trace.get('status')}"
    return None


def select(
    traces: list[dict[str, Any]], include_all: bool = False, roles: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The traces to export, in a stable order (group, sample, rollout, creation, trace id), and
    how many were left out for what reason."""
    kept, skipped = [], Counter()
    for t in traces:
        why = left_out_reason(t, include_all, roles)
        if why:
            skipped[why] += 1
        else:
            kept.append(t)
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    kept.sort(
        key=lambda t: (
            t.get("group_id") or t["rollout_id"],
            t.get("sample_index") if t.get("sample_index") is not None else -1,
            t["rollout_id"],
            t.get("created_at") or epoch,
            0 if t.get("role") == "main" else 1,
            t["trace_id"],
        )
    )
    return kept, skipped


def build_records(
    traces: list[dict[str, Any]], calls_by_id: dict[str, dict[str, Any]]
) -> list[Record]:
    groups: dict[str, int] = {}
    out = []
    for i, t in enumerate(traces):
        group = t.get("group_id") or f"rollout:{t['rollout_id']}"
        gi = groups.setdefault(group, len(groups))
        calls = [calls_by_id.get(c) for c in t.get("call_ids") or []]
        out.append(Record(t, segments(t), calls, gi, i))
    return out


def decode(options: ExportOptions, ids: Sequence[int]) -> str:
    """Text of ``ids`` with the export's tokenizer, "" without one (the ids are what counts)."""
    if options.tokenizer is None or not ids:
        return ""
    with options.tokenizer.lock:
        return options.tokenizer.decode(list(ids))
