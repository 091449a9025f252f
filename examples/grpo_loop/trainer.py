#!/usr/bin/env python3
"""The loop's trainer: verl's GRPO maths on what polar-mitm captured, a torch step, a checkpoint.

Runs in the trainer venv (Python 3.11, torch CPU, transformers, verl 0.9.1; no polar_mitm import)
as a long-lived worker, so the model and AdamW's state stay in memory between iterations:

    python trainer.py --weights DIR --out CKPT_ROOT [--lr 3e-5]

reads one JSON command per line on stdin and answers one JSON line on stdout:

- ``{"cmd": "step", "batch": "it3.npz", "version": "step-4"}``: the batch is one iteration's
  ``polar-mitm export --format verl`` file (the project's export). Before the step it recomputes
  every policy token's logprob with the weights that sampled it (the last pushed checkpoint) and
  compares it with the logprob the proxy captured (``rollout_log_probs``): that is the check that
  the push was exact. Then verl's ``compute_grpo_outcome_advantage`` (grouped by ``uid``) and
  verl's policy loss (``get_policy_loss_fn`` with an ``ActorConfig``, ``old_log_prob =
  rollout_log_probs``: verl's bypass mode) on ``response_mask`` less the tokens sampled under a
  grammar (``constrained_mask``), one AdamW step, and the new weights written as CKPT_ROOT/VERSION
  atomically (a temp folder renamed into place), untied, float32 safetensors.
- ``{"cmd": "score", "batch": "it9.npz"}``: only the check, no step (after the last push).
- ``{"cmd": "quit"}``.

``python trainer.py --weights CKPT --score BATCH`` prints the check for one checkpoint and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RATIO_LOW, RATIO_HIGH = 0.8, 1.25


def log_probs(model: Any, batch: dict[str, Any]):
    """log p(response token | prefix) per row, [B, R], each row without its padding."""
    import torch

    ids, attn = batch["input_ids"], batch["attention_mask"]
    p_width, r_width = batch["prompts"].shape[1], batch["responses"].shape[1]
    rows = []
    for i in range(ids.shape[0]):
        keep = attn[i].bool()
        p, n = int(attn[i, :p_width].sum()), int(attn[i, p_width:].sum())
        x = ids[i][keep][None]
        logits = model(input_ids=x, position_ids=batch["position_ids"][i][keep][None]).logits[0]
        lp = torch.log_softmax(logits[p - 1 : p - 1 + n].float(), dim=-1)
        rows.append(
            torch.nn.functional.pad(lp.gather(1, x[0, p : p + n, None])[:, 0], (0, r_width - n))
        )
    return torch.stack(rows)


def load(batch_path: str) -> tuple[dict[str, Any], Any, Any, Any]:
    """(2-D tensors, uid, the mask to train on, captured logprobs) of a verl export."""
    import torch

    z = np.load(batch_path)  # no allow_pickle: the export never needs it
    batch = {k: torch.from_numpy(z[k]) for k in z.files if z[k].ndim == 2}
    mask = batch["response_mask"].bool()
    if "constrained_mask" in batch:  # sampled under a grammar: the grammar's logprobs, not ours
        mask &= ~batch["constrained_mask"].bool()
    return batch, z["uid"].astype(object), mask, batch["rollout_log_probs"].float()


def compare(new: Any, old: Any, mask: Any) -> dict[str, Any]:
    """mean / max |trainer - captured| on the policy tokens, and the importance ratios' share in
    [0.8, 1.25]: with the weights that sampled them, 0 and 1.0 up to float noise."""
    import torch

    diff = (new - old)[mask].abs()
    ratio = torch.exp(new - old)[mask]
    return {
        "exact": {
            "mean_abs": float(diff.mean()),
            "max_abs": float(diff.max()),
            "n": int(diff.numel()),
        },
        "ratios_in_range": float(((ratio >= RATIO_LOW) & (ratio <= RATIO_HIGH)).float().mean()),
    }


def save_atomically(model: Any, tokenizer_dir: Path, out: Path) -> None:
    """`out` appears whole or not at all: written beside it, then renamed into place."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


class Trainer:
    def __init__(self, weights: Path, out: Path, lr: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig

        torch.manual_seed(0)
        self.core_algos, self.ActorConfig = core_algos, ActorConfig
        self.weights, self.out = weights, out
        self.model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
        if self.model.config.tie_word_embeddings:
            raise SystemExit(
                f"error: {weights} ties its embeddings: serve an untied copy (convert.py)"
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def score(self, batch_path: str) -> dict[str, Any]:
        """The check alone: this model's logprobs against the captured ones."""
        import torch

        batch, _uid, mask, old = load(batch_path)
        with torch.no_grad():
            new = log_probs(self.model, batch)
        return compare(new, old, mask)

    def step(self, batch_path: str, version: str) -> dict[str, Any]:
        import torch

        t0 = time.monotonic()
        batch, uid, mask, old = load(batch_path)
        self.model.train()
        new = log_probs(self.model, batch)
        t_fwd = time.monotonic()
        check = compare(new.detach(), old, mask)
        adv, _ = self.core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=batch["rm_scores"].float(), response_mask=mask.long(), index=uid
        )
        config = self.ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=len(uid)
        )
        loss_fn = self.core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
        loss, _metrics = loss_fn(
            old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
            loss_agg_mode=config.loss_agg_mode, config=config,
        )  # fmt: skip
        self.opt.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.opt.step()
        t_step = time.monotonic()
        self.model.eval()
        out = self.out / version
        save_atomically(self.model, self.weights, out)
        t_save = time.monotonic()
        return {
            "checkpoint": str(out),
            "rows": len(uid),
            "policy_tokens": int(mask.sum()),
            **check,
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "seconds": {"forward": t_fwd - t0, "step": t_step - t_fwd, "save": t_save - t_step},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--score", metavar="BATCH", help="print the check for --weights and exit")
    a = p.parse_args()
    if not a.score:
        a.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(a.weights, a.out, a.lr)
    if a.score:
        print(json.dumps(trainer.score(a.score)))
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            if cmd.get("cmd") == "score":
                answer = trainer.score(cmd["batch"])
            else:
                answer = trainer.step(cmd["batch"], cmd["version"])
        except Exception as e:  # one line back to the loop, which reports it
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
