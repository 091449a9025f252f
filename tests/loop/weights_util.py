"""Checkpoints for the weight-push tests, made from the served model with numpy: a valid one whose
weights differ, and broken ones of each kind the check must refuse; and the trainer's check of a
set of captured calls (examples/grpo_loop/trainer.py --score, in the trainer venv)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from .conftest import RECIPE, TRAINER_PY


def header(path: Path) -> tuple[int, dict[str, Any]]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def clone(src: Path, dst: Path, weights: bool = True) -> Path:
    """`dst` with `src`'s small files copied and (unless `weights` is False) its weights linked."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            if weights:
                os.symlink(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


def edited(src: Path, dst: Path, tensor: str, edit) -> Path:
    """A copy of `src` whose float32 tensor `tensor` is `edit(array)` (in place)."""
    clone(src, dst, weights=False)
    [st] = sorted(src.glob("*.safetensors"))
    shutil.copyfile(st, dst / st.name)
    base, h = header(dst / st.name)
    start, stop = h[tensor]["data_offsets"]
    assert h[tensor]["dtype"] == "F32"
    mm = np.memmap(dst / st.name, dtype="<f4", mode="r+", offset=base + start,
                   shape=((stop - start) // 4,))  # fmt: skip
    edit(mm)
    mm.flush()
    del mm
    return dst


def scaled(src: Path, dst: Path, factor: float = 1.3) -> Path:
    """A valid checkpoint with different weights: the final norm scaled."""
    return edited(src, dst, "model.norm.weight", lambda a: a.__imul__(factor))


def calls_batch(rows: list[dict], out: Path) -> Path:
    """Captured calls as verl's batch layout (the keys trainer.py reads): prompt = the call's
    prompt ids, response = its sampled ids with the logprobs the proxy captured."""
    p = max(len(r["prompt_token_ids"]) for r in rows)
    n = max(len(r["output_token_ids"]) for r in rows)
    b = len(rows)
    prompts, responses = np.zeros((b, p), np.int64), np.zeros((b, n), np.int64)
    pa, ra = np.zeros((b, p), np.int64), np.zeros((b, n), np.int64)
    lp = np.zeros((b, n), np.float32)
    for i, r in enumerate(rows):
        pi, oi = r["prompt_token_ids"], r["output_token_ids"]
        prompts[i, p - len(pi) :], pa[i, p - len(pi) :] = pi, 1
        responses[i, : len(oi)], ra[i, : len(oi)] = oi, 1
        lp[i, : len(oi)] = r["output_logprobs"]
    attn = np.concatenate([pa, ra], 1)
    np.savez(
        out,
        prompts=prompts,
        responses=responses,
        response_mask=ra,
        input_ids=np.concatenate([prompts, responses], 1),
        attention_mask=attn,
        position_ids=np.clip(np.cumsum(attn, 1) - 1, 0, None),
        rollout_log_probs=lp,
        uid=np.array([r["rollout_id"] for r in rows]),
    )
    return out


def trainer_check(weights: Path, rows: list[dict], out: Path) -> dict[str, Any]:
    """The trainer's logprobs of `weights` against the captured ones of these calls."""
    batch = calls_batch(rows, out)
    r = subprocess.run(
        [str(TRAINER_PY), str(RECIPE / "trainer.py"), "--weights", str(weights), "--score", str(batch)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
