"""verl's own code on a polar-mitm export (``train_check.py --trainer verl``; trainer venv).

The field-level tests say the ``--format verl`` file has verl's keys and dtypes; this runs what
verl runs on such a batch, so a wrong sign, a shifted mask or a grouping key verl reads differently
shows up as a wrong number, not as a passing field check:

1. the ``.npz`` (made here with ``polar-mitm export DATA --format verl`` when DATA is a directory)
   becomes a ``verl.DataProto`` through ``DataProto.from_dict``, as docs/export.md says to load it;
2. ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` on ``rm_scores`` with
   ``index = non_tensor_batch["uid"]`` (what verl's trainer passes); then, with verl's function
   again, each group's advantages are shown to depend on its own rows' rewards and no other's;
3. log-probs of every response token recomputed with transformers + torch on the same weights
   (verl's actor does this forward; here without padding, as its ``use_remove_padding`` path);
4. verl's PPO policy loss (``get_policy_loss_fn("vanilla")`` with an ``ActorConfig``, its default
   ``token-mean`` aggregation through ``agg_loss``) with ``old_log_prob = rollout_log_probs``
   (verl's bypass mode: the engine's logprobs are the old policy), then ``backward()``: the
   gradient reaching each token's log-prob must be non-zero on policy tokens and exactly zero on
   the rest (tool output, template, padding).

Imported by train_check.py (same folder; neither imports the other's internals: the statistics
they share are check_stats.py's) only when ``--trainer verl`` is asked: verl pulls in ray
and tensordict, which the other checks do not need.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from check_stats import stats  # same folder: train_check puts it on sys.path

CLIP = 0.2


def verl_modules() -> tuple[Any, Any, Any, str]:
    """verl's DataProto, core_algos and ActorConfig, or a one-line error naming what to install."""
    try:
        import verl
        from verl import DataProto
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig
    except ImportError as e:
        raise SystemExit(
            f"error: verl is not importable in this venv ({e}); scripts/_python.sh "
            "polar_trainer_venv installs verl==0.9.1 and the few packages it imports"
        ) from e
    return DataProto, core_algos, ActorConfig, verl.__version__


def export_npz(data: Path, polar_mitm: str | None, workdir: Path) -> Path:
    """``data`` itself when it is an .npz, else ``polar-mitm export data --format verl``'s file."""
    if data.is_file():
        return data
    cmd = shlex.split(polar_mitm) if polar_mitm else None
    if cmd is None:
        found = shutil.which("polar-mitm")
        if found is None:
            raise SystemExit(
                f"error: {data} is a directory and there is no polar-mitm on PATH to export it: "
                "pass --polar-mitm CMD, or an .npz made with `polar-mitm export --format verl`"
            )
        cmd = [found]
    out = workdir / "batch.npz"
    r = subprocess.run(
        [*cmd, "export", str(data), "--format", "verl", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    print(r.stderr.strip())
    if r.returncode != 0 or not out.exists():
        raise SystemExit(f"error: polar-mitm export --format verl failed ({r.returncode})")
    return out


def load_batch(path: Path, DataProto: Any) -> Any:
    """The export as a DataProto: 2-D arrays are the tensor batch, 1-D ones the non-tensor batch."""
    import torch

    z = np.load(path)  # no allow_pickle: the export never needs it
    return DataProto.from_dict(
        tensors={k: torch.from_numpy(z[k]) for k in z.files if z[k].ndim == 2},
        non_tensors={k: z[k].astype(object) for k in z.files if z[k].ndim == 1},
    )


def _row_advantages(adv, mask) -> list[float]:
    """One number per row: GRPO's advantage is the same on every response token of a sample."""
    import torch

    out = []
    for a, m in zip(adv, mask, strict=True):
        vals = a[m]
        if vals.numel() and not torch.allclose(vals, vals[:1].expand_as(vals)):
            raise SystemExit("error: verl's GRPO advantage varies within one sample")
        out.append(float(vals[0]) if vals.numel() else 0.0)
    return out


def grouping_check(core_algos: Any, scores, mask, uid: np.ndarray) -> dict[str, dict]:
    """With verl's function: does a group's advantage move when, and only when, its own rows'
    rewards move? Per group: the largest change when every *other* row's reward is perturbed
    (must be 0), and whether each other member's advantage changed when one member's did."""
    import torch

    def advantages(rewards):
        token_rewards = torch.zeros(mask.shape)
        token_rewards[:, -1] = rewards  # GRPO sums over the response: the position is irrelevant
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=token_rewards, response_mask=mask, index=uid
        )
        return torch.tensor(_row_advantages(adv, mask.bool()))

    base = advantages(scores)
    rng = torch.Generator().manual_seed(0)
    out = {}
    for g in sorted(set(uid.tolist())):
        inside = torch.tensor([u == g for u in uid.tolist()])
        noise = torch.rand(len(uid), generator=rng) * 10 + 1
        outside_moved = advantages(torch.where(inside, scores, scores + noise))
        first = int(inside.nonzero()[0])
        bumped = scores.clone()
        bumped[first] += 1.0
        inside_moved = advantages(bumped)
        others = inside.clone()
        others[first] = False
        out[g] = {
            "rows": int(inside.sum()),
            "max_change_when_other_groups_move": float((outside_moved - base)[inside].abs().max()),
            "members_moved_with_one_member": int(
                ((inside_moved - base)[others].abs() > 1e-6).sum()
            ),
            "other_members": int(others.sum()),
        }
    return out


def recompute_log_probs(model: Any, batch: Any):
    """log p(response token | everything before it) for every row, [B, R], with the graph kept.

    Each row runs without its padding (verl's remove-padding path) and with the exported
    ``position_ids``; response position j of a row whose prompt has p tokens is predicted by the
    logits at p + j - 1. Padding positions hold 0 and no graph."""
    import torch

    ids, attn, pos = (batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    p_width = batch.batch["prompts"].shape[1]
    r_width = batch.batch["responses"].shape[1]
    rows = []
    for i in range(ids.shape[0]):
        keep = attn[i].bool()
        p = int(attn[i, :p_width].sum())
        n = int(attn[i, p_width:].sum())
        if p == 0:
            raise SystemExit(f"error: row {i} has an empty prompt: nothing to condition on")
        x = ids[i][keep][None]
        logits = model(input_ids=x, position_ids=pos[i][keep][None]).logits[0].float()
        logp = torch.log_softmax(logits[p - 1 : p - 1 + n], dim=-1)
        lp = logp.gather(1, x[0, p : p + n, None])[:, 0]
        rows.append(torch.nn.functional.pad(lp, (0, r_width - n)))
    return torch.stack(rows)


def prepare(data: Path, polar_mitm: str | None) -> Any:
    """The DataProto to train on, checked before any model is loaded (errors come fast)."""
    DataProto, *_ = verl_modules()
    with tempfile.TemporaryDirectory() as tmp:
        batch = load_batch(export_npz(data, polar_mitm, Path(tmp)), DataProto)
    if "rm_scores" not in set(batch.batch.keys()):
        raise SystemExit(
            "error: the export has no rm_scores (some record has no reward): end the rollouts "
            "with a reward through the control plane, or join rewards with `polar-mitm reward`"
        )
    return batch


def run(model: Any, batch: Any, low: float, high: float) -> dict[str, Any]:
    """Every step above on the batch from ``prepare``; the figures as a dict."""
    import torch

    _, core_algos, ActorConfig, version = verl_modules()
    t0 = time.monotonic()
    b = len(batch)
    mask = batch.batch["response_mask"].bool()
    uid = batch.non_tensor_batch["uid"]
    sizes = dict(Counter(str(u) for u in uid.tolist()))
    keys = sorted(batch.batch.keys())
    print(f"verl {version}: DataProto of {b} rows, keys {keys}, groups (uid) {sizes}")
    rm_scores = batch.batch["rm_scores"].float()
    adv, _returns = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rm_scores, response_mask=batch.batch["response_mask"], index=uid
    )
    row_adv = _row_advantages(adv, mask)
    scores = rm_scores.sum(-1)
    groups = grouping_check(core_algos, scores, batch.batch["response_mask"], uid)
    for g, c in groups.items():
        print(
            f"  group {g!r}: {c['rows']} rows; other groups' rewards moved -> max change "
            f"{c['max_change_when_other_groups_move']:.2e}; one member's moved -> "
            f"{c['members_moved_with_one_member']}/{c['other_members']} other members moved"
        )

    model.eval()
    log_prob = recompute_log_probs(model, batch)
    log_prob.retain_grad()
    old = batch.batch["rollout_log_probs"].float()
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=b)
    loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    # verl's bypass mode (rollout_corr_helper.apply_bypass_mode): old_log_probs = rollout_log_probs
    loss, metrics = loss_fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
    )
    model.zero_grad()
    loss.backward()
    grad_norm = math.sqrt(
        sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )
    g = log_prob.grad
    ratio = torch.exp(log_prob.detach() - old)
    attn_r = batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].bool()
    clipped = mask & ((ratio < 1 - config.clip_ratio_low) | (ratio > 1 + config.clip_ratio_high))
    # where PPO's clipped term is the active one (or dual-clip's constant, A = 0, or verl's clamp
    # of the log-ratio) the token's
    # gradient is 0 by design; everywhere else on the mask it must not be
    flat = (
        ((adv > 0) & (ratio > 1 + config.clip_ratio_high))
        | ((adv < 0) & (ratio < 1 - config.clip_ratio_low))
        | ((adv < 0) & (ratio > config.clip_ratio_c))
        | (adv == 0)
        | ((log_prob.detach() - old).abs() > 20)  # verl clamps the log-ratio to [-20, 20]
    )
    r = ratio[mask].numpy().astype(np.float64)
    delta = (log_prob.detach() - old)[mask].abs().numpy().astype(np.float64)
    report = {
        "verl_version": version,
        "rows": b,
        "uid": [str(u) for u in uid.tolist()],
        "rollout_id": [str(u) for u in batch.non_tensor_batch["rollout_id"].tolist()],
        "scores": [float(s) for s in scores],
        "advantages": row_adv,
        "groups": groups,
        "policy_tokens": int(mask.sum()),
        "exact_ids": stats(delta),
        "ratios": {
            "n": int(r.size),
            "mean": float(r.mean()),
            "min": float(r.min()),
            "max": float(r.max()),
            f"in_{low}_{high}": float(np.mean((r >= low) & (r <= high))),
            "clipped": float(clipped.sum()) / max(1, int(mask.sum())),
        },
        "loss": float(loss.detach()),
        "loss_agg_mode": config.loss_agg_mode,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "grad": {
            "norm": grad_norm,
            "policy_tokens_nonzero": int(((g != 0) & mask).sum()),
            "policy_tokens_flat_by_design": int((mask & flat).sum()),
            "response_tokens_not_policy": int((attn_r & ~mask).sum()),
            "padding_tokens": int((~attn_r).sum()),
            "non_policy_tokens_nonzero": int(((g != 0) & ~mask).sum()),
        },
        "seconds": time.monotonic() - t0,
    }
    gr = report["grad"]
    print(
        f"  recomputed log-probs: |rollout - recomputed| mean {report['exact_ids'].get('mean', 0):.4f}"
        f", max {report['exact_ids'].get('max', 0):.4f} nats over {report['policy_tokens']} policy tokens"
    )
    print(
        f"  step 0 ratios: in [{low}, {high}] {report['ratios'][f'in_{low}_{high}']:.2%}, "
        f"min {r.min():.4f}, max {r.max():.4f}; verl policy loss ({config.loss_agg_mode}) "
        f"{report['loss']:.6f}, grad norm {grad_norm:.4f}"
    )
    print(
        f"  d loss / d log-prob non-zero on {gr['policy_tokens_nonzero']}/{report['policy_tokens']} "
        f"policy tokens ({gr['policy_tokens_flat_by_design']} where the clipped term or A = 0 rules) "
        f"and on {gr['non_policy_tokens_nonzero']} of the {gr['response_tokens_not_policy']} "
        f"non-policy response tokens and {gr['padding_tokens']} padding slots"
    )
    return report


def failures(report: dict[str, Any], min_in_range: float | None, low: float, high: float) -> list:
    """What the numbers say is wrong (train_check exits 1 on any)."""
    out = []
    if not math.isfinite(report["loss"]):
        out.append("verl's policy loss is not finite")
    gr = report["grad"]
    if gr["non_policy_tokens_nonzero"]:
        out.append(f"gradient on {gr['non_policy_tokens_nonzero']} non-policy token(s)")
    if gr["policy_tokens_nonzero"] != report["policy_tokens"] - gr["policy_tokens_flat_by_design"]:
        out.append("the gradient is 0 on a policy token where the loss depends on it")
    for g, c in report["groups"].items():
        if c["max_change_when_other_groups_move"] != 0:
            out.append(f"group {g!r}'s advantages move with other groups' rewards")
        if c["members_moved_with_one_member"] != c["other_members"]:
            out.append(f"group {g!r}'s members do not share one baseline")
    ratio = report["ratios"][f"in_{low}_{high}"]
    if min_in_range is not None and ratio < min_in_range:
        out.append(f"step-0 ratios in [{low}, {high}]: {ratio:.4f} < {min_in_range}")
    return out
