"""slime (THUDM/slime): one JSON line per trace, a `slime.utils.types.Sample` as ``to_dict()`` gives it.

Field names and meaning as in ``slime/utils/types.py`` and ``RolloutManager._convert_samples_to_train_data``
(``slime/ray/rollout.py``), commits cited in docs/export.md: ``tokens`` is the whole sequence,
``response_length`` the tokens after the prompt, ``loss_mask`` and ``rollout_log_probs`` cover the
response only (slime asserts ``len(loss_mask) == response_length``), ``status`` is a
``Sample.Status`` value. A multi-turn trace is one Sample whose response holds the environment's
tokens with mask 0, as slime's own multi-turn rollouts build it. Load with
``Sample.from_dict(json.loads(line))``.
"""

from __future__ import annotations

from typing import Any

from .base import ExportOptions, Record, decode, jsonl_format

# Sample.Status values (slime/utils/types.py)
_STATUS = {"completed": "completed", "incomplete": "aborted", "error": "failed"}


def status(record: Record) -> str:
    """``truncated`` when the last call stopped at its length limit (slime's TRUNCATED)."""
    s = _STATUS.get(record.trace.get("status") or "", "aborted")
    if s == "completed" and record.last_finish_reason == "length":
        return "truncated"
    return s


def sample(record: Record, options: ExportOptions) -> dict[str, Any]:
    t = record.trace
    p = record.prompt_length
    ids = list(t["input_ids"])
    return {
        "group_index": record.group_index,
        "index": record.index,
        "prompt": decode(options, ids[:p]),
        "tokens": ids,
        "response": decode(options, ids[p:]),
        "response_length": len(ids) - p,
        "label": None,
        "reward": t.get("reward"),
        "loss_mask": [int(m) for m in t["loss_mask"][p:]],
        "weight_versions": list(t.get("policy_versions") or []),
        "rollout_log_probs": [float(x) for x in t["logprobs"][p:]],
        "status": status(record),
        "metadata": record.metadata(),
        "session_id": t["rollout_id"],
    }


FORMAT = jsonl_format(
    "slime",
    "slime Sample dicts, one per line (Sample.from_dict)",
    sample,
)
