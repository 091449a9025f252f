"""NeMo Gym (NVIDIA-NeMo/Gym): one rollout result per line, token ids on each assistant turn.

The shape NeMo RL's ``NemoGym._postprocess_nemo_gym_to_nemo_rl_result`` consumes (commit in
docs/export.md): ``{"responses_create_params": {...}, "response": {...,"output": [items]},
"reward": r}``, where every item the policy sampled carries ``prompt_token_ids`` (the whole prompt
of that call), ``generation_token_ids`` and ``generation_log_probs`` — Gym's
``TokenIDLogProbMixin`` on ``NeMoGymResponseOutputMessageForTraining``. NeMo RL rebuilds the
sequence from them and checks that each turn's prompt starts with everything before it, which is
exactly how a polar-mitm trace was merged. Each turn repeats its whole prompt, so a long trace makes
a long line (the format's cost, not ours to change).
"""

from __future__ import annotations

import json
from typing import Any

from .base import ExportFormat, ExportOptions, Record, decode

_STATUS = {"completed": "completed", "incomplete": "incomplete", "error": "failed"}


def result(record: Record, options: ExportOptions) -> dict[str, Any]:
    t = record.trace
    ids, lps = list(t["input_ids"]), [float(x) for x in t["logprobs"]]
    output = []
    for seg in record.segments:
        output.append(
            {
                "id": seg.call_id or f"{t['trace_id']}-{seg.index}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": decode(options, ids[seg.gen_start : seg.end]),
                        "annotations": [],
                    }
                ],
                "prompt_token_ids": ids[: seg.gen_start],
                "generation_token_ids": ids[seg.gen_start : seg.end],
                "generation_log_probs": lps[seg.gen_start : seg.end],
            }
        )
    created = t.get("created_at")
    response = {
        "id": t["trace_id"],
        "object": "response",
        "created_at": created.timestamp() if created is not None else 0.0,
        "model": record.model or "",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "status": _STATUS.get(t.get("status") or "", "incomplete"),
        "metadata": {"rollout_id": t["rollout_id"], "trace_id": t["trace_id"]},
    }
    return {
        "responses_create_params": {"input": []},
        "response": response,
        "reward": t.get("reward"),
        "polar": record.metadata(),
    }


def write(records: list[Record], path: str, options: ExportOptions) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(result(r, options), ensure_ascii=False, allow_nan=False))
            f.write("\n")


FORMAT = ExportFormat(
    name="nemo-gym",
    suffix=".jsonl",
    summary="NeMo Gym rollout results, per-turn prompt/generation token ids and log probs",
    write=write,
)
