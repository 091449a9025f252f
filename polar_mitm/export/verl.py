"""verl (volcengine/verl): a ``DataProto`` batch as a torch-free NumPy ``.npz``.

The keys, shapes and dtypes are those verl's agent loop hands the trainer
(``verl/experimental/agent_loop/agent_loop.py``, ``AgentLoopWorker._postprocess``; commit in
docs/export.md): ``prompts`` [B, P] left-padded, ``responses`` [B, R] right-padded,
``response_mask`` [B, R] (1 = sampled by the policy, 0 = tool output / template / padding),
``input_ids`` / ``attention_mask`` / ``position_ids`` [B, P+R], all int64 (torch.long), and
``rollout_log_probs`` [B, R] float32, 0 where masked. ``rm_scores`` [B, R] float32 holds the reward
on the last response token, as verl puts a precomputed reward score, and is written only when every
record has a reward. ``constrained_mask`` [B, R] int64 (not verl's: polar-mitm's) is 1 on the
response tokens sampled under a grammar (docs/constrained.md), whose ``rollout_log_probs`` are
the grammar's, not the policy's: ``response_mask * (1 - constrained_mask)`` leaves them out. The 1-D arrays are the non-tensor batch: ``uid`` (verl's GRPO grouping key:
the GRPO group, else the rollout), and the record's origin. Load:

    z = np.load(path)
    batch = DataProto.from_dict(
        tensors={k: torch.from_numpy(z[k]) for k in z.files if z[k].ndim == 2},
        non_tensors={k: z[k].astype(object) for k in z.files if z[k].ndim == 1})

Why ``.npz``: it is the batch as verl holds it (no re-padding, no glue), readable without torch,
and the strings are fixed-width unicode arrays, so ``np.load`` needs no pickle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import ExportFormat, ExportOptions, Record

if TYPE_CHECKING:
    import numpy as np

TENSOR_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "rm_scores",
    "constrained_mask",
)


def arrays(records: list[Record], options: ExportOptions) -> dict[str, np.ndarray]:
    import numpy as np  # here, not at import: the CLI imports every format to list them

    b = len(records)
    p_len = max((r.prompt_length for r in records), default=0)
    r_len = max((len(r.trace["input_ids"]) - r.prompt_length for r in records), default=0)
    prompts = np.full((b, p_len), options.pad_id, dtype=np.int64)
    responses = np.full((b, r_len), options.pad_id, dtype=np.int64)
    response_mask = np.zeros((b, r_len), dtype=np.int64)
    prompt_attention = np.zeros((b, p_len), dtype=np.int64)
    response_attention = np.zeros((b, r_len), dtype=np.int64)
    logprobs = np.zeros((b, r_len), dtype=np.float32)
    rewards = [r.trace.get("reward") for r in records]
    scores = np.zeros((b, r_len), dtype=np.float32)
    constrained = np.zeros((b, r_len), dtype=np.int64)
    for i, r in enumerate(records):
        ids = np.asarray(r.trace["input_ids"], dtype=np.int64)
        mask = np.asarray(r.trace["loss_mask"], dtype=np.int64)
        lps = np.asarray(r.trace["logprobs"], dtype=np.float32)
        p = r.prompt_length
        n = len(ids) - p
        prompts[i, p_len - p :] = ids[:p]
        prompt_attention[i, p_len - p :] = 1
        responses[i, :n] = ids[p:]
        response_attention[i, :n] = 1
        response_mask[i, :n] = mask[p:]
        logprobs[i, :n] = lps[p:]
        if rewards[i] is not None and n:
            scores[i, n - 1] = rewards[i]
        spans = r.trace.get("constrained_spans") or ()
        for start, end in zip(spans[::2], spans[1::2], strict=True):
            constrained[i, max(0, start - p) : max(0, end - p)] = 1
    attention = np.concatenate([prompt_attention, response_attention], axis=1)
    out: dict[str, np.ndarray] = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        # verl.utils.model.compute_position_id_with_mask: clip(cumsum(mask) - 1, min=0)
        "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64),
        "rollout_log_probs": logprobs,
        "constrained_mask": constrained,
    }
    if records and all(x is not None for x in rewards):
        out["rm_scores"] = scores
    meta = [r.metadata() for r in records]
    out["uid"] = np.array([m["group_id"] or m["rollout_id"] for m in meta], dtype=str)
    for key in ("rollout_id", "trace_id", "role", "break_reason", "status"):
        out[key] = np.array([m[key] or "" for m in meta], dtype=str)
    out["sample_index"] = np.array(
        [-1 if m["sample_index"] is None else m["sample_index"] for m in meta], dtype=np.int64
    )
    out["reward"] = np.array([np.nan if x is None else x for x in rewards], dtype=np.float64)
    out["trainable"] = np.array([bool(m["trainable"]) for m in meta], dtype=bool)
    return out


def write(records: list[Record], path: str, options: ExportOptions) -> dict[str, Any]:
    import numpy as np

    data = arrays(records, options)
    with open(path, "wb") as f:
        np.savez_compressed(f, **data)
    return {
        "prompt_length": int(data["prompts"].shape[1]),
        "response_length": int(data["responses"].shape[1]),
        "rm_scores": "rm_scores" in data,
    }


FORMAT = ExportFormat(
    name="verl",
    suffix=".npz",
    summary="verl DataProto batch keys as a NumPy .npz (torch-free)",
    write=write,
)
