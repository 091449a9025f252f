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

from typing import Any

from ..nemo_gym.items import STATUS, output_items, response
from .base import ExportOptions, Record, decode, jsonl_format


def result(record: Record, options: ExportOptions) -> dict[str, Any]:
    t = record.trace
    created = t.get("created_at")
    return {
        "responses_create_params": {"input": []},
        "response": response(
            t["trace_id"],
            record.model or "",
            output_items(t, lambda ids: decode(options, ids)),
            STATUS.get(t.get("status") or "", "incomplete"),
            {"rollout_id": t["rollout_id"], "trace_id": t["trace_id"]},
            created.timestamp() if created is not None else 0.0,
        ),
        "reward": t.get("reward"),
        "polar": record.metadata(),
    }


FORMAT = jsonl_format(
    "nemo-gym",
    "NeMo Gym rollout results, per-turn prompt/generation token ids and log probs",
    result,
)
