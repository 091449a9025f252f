"""Plain JSONL: each trace row as it is in `traces/` (store/schema.py), plus its per-call segments.

For trainers without a format here, and for people: ``input_ids``, ``loss_mask`` (1 = sampled by
the policy), ``logprobs`` (aligned, 0 where masked), ``reward``, ``group_id`` ... under their
schema names; timestamps as ISO 8601; ``segments`` gives each call's ``start`` / ``gen_start`` /
``end`` in ``input_ids``; ``prompt_length`` is the first call's prompt.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .base import Record, jsonl_format


def _plain(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value


def line(record: Record) -> dict[str, Any]:
    out = {k: _plain(v) for k, v in record.trace.items()}
    out["prompt_length"] = record.prompt_length
    out["segments"] = [
        {"call_id": s.call_id, "start": s.start, "gen_start": s.gen_start, "end": s.end}
        for s in record.segments
    ]
    return out


FORMAT = jsonl_format(
    "jsonl",
    "the trace rows as JSON lines (schema column names) with per-call segments",
    lambda record, options: line(record),
)
