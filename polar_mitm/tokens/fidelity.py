"""Fidelity checks of every captured call, off the hot path (`polar_fidelity`).

`FidelityStage` checks a finished call after the harness has its whole reply, in one worker
thread — FIFO, so records reach the store in the order they finished. It is one step of the
call's pipeline (`addons/pipeline.py`): the merge into its rollout comes before it, and hands it
the merge's evidence; the store and the metrics come after it. Two kinds of checks:

* the call's own tokens (known at once): ``bpe_resplit`` / ``special_tokens`` (the sampled
  ids decoded and encoded again differ; `drift.roundtrip`), ``special_tokens`` in the
  request's text (a server turns them into control tokens), ``count_mismatch`` (ids vs the
  server's ``usage``, prompt and output), ``constrained_sampling`` (tokens sampled under a
  grammar, whose logprobs are the grammar's: `upstream/constraints.py`);
* an earlier turn as re-rendered into this call's prompt (known only when this later call
  arrives): when the merge says this call broke off its chain with reason ``rerender`` (every
  earlier message still there, yet other tokens), the pipeline copies the merge's own evidence
  into a `RerenderJob` — the parent chain, the common prefix, the call holding the first
  differing token — and the checks explain it: ``template_rerender`` and its causes
  ``reasoning_dropped``, ``tool_args_reserialized``, ``bpe_resplit``, ``special_tokens``
  (`drift.classify_turn`), turn by turn from there on.

Shards are immutable, so a drift of call N seen in call N+1's prompt is stored on call N+1:
its ``fidelity_flags`` and ``fidelity_json[flag]`` name the turn (``turn_call_id``), the
position, and a short decoded context on both sides; ``fidelity_json["wrong_tokens"]`` maps
each turn's call id to the sampled tokens a text pipeline gets wrong. Traces carry a summary
(`drift.trace_summary`).

Modes: ``off`` (no checks), ``check`` (flag; trainability unchanged), ``strict`` (a flagged
call is not trainable, and any drift flag in a rollout makes all its traces untrainable:
``fidelity_strict``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.record import CallRecord, awaitable, one_receipt
from ..core.tasks import drain_tasks
from ..upstream.constraints import CONSTRAINED_SAMPLING
from .drift import (
    CONTEXT,
    COUNT_MISMATCH,
    FLAGS,
    SPECIAL_TOKENS,
    TEMPLATE_RERENDER,
    classify_turn,
    context,
    find_ids,
    roundtrip,
)
from .tokenizer import PolicyTokenizer

log = logging.getLogger("polar_mitm")

OFF, CHECK, STRICT = "off", "check", "strict"
MODES = (OFF, CHECK, STRICT)
# a grammar's logprobs are not the policy's either (upstream/constraints.py)
DRIFT_FLAGS = frozenset(FLAGS) | {CONSTRAINED_SAMPLING}
ANCHOR = 32  # tokens of an environment turn's end used to find it in a re-rendered prompt
# A first difference this close before a sampled turn is the turn's own (BPE merged the
# prompt's last token with the re-rendered turn's first: no special token between them).
BOUNDARY = 2
MAX_PENDING = 10_000  # calls waiting for the worker beyond this are stored unchecked
PROMPT_COUNT_MISMATCH = "prompt_count_mismatch"
_SNIPPET = 40  # characters either side of special-token text in a request


@dataclass(slots=True, kw_only=True)
class RerenderJob:
    """What the merge knows about a ``rerender`` break, copied on the event loop: the parent
    chain from just before the common prefix on, and where its calls' tokens lie."""

    parent_trace_id: str
    lcp: int
    base: int  # chain position of tokens[0]
    tokens: array
    turns: list[tuple[str, int, int, int]]  # (call_id, call start, output start, end)
    where: str  # "policy" | "env": the kind of chain token at the first difference


@dataclass(slots=True)
class Findings:
    flags: dict[str, dict[str, Any]] = field(default_factory=dict)  # flag -> first occurrence
    wrong: dict[str, int] = field(default_factory=dict)  # turn call id -> wrong tokens
    turns: dict[str, list[str]] = field(default_factory=dict)  # flag -> turn call ids
    error: str | None = None

    def add(self, flag: str, turn: str, detail: dict[str, Any]) -> None:
        self.flags.setdefault(flag, detail)
        turns = self.turns.setdefault(flag, [])
        if turn not in turns:
            turns.append(turn)


# -- the checks (blocking, in the worker) ---------------------------------------------------------


def local_checks(tok: PolicyTokenizer | None, record: CallRecord) -> Findings:
    """Checks of the call's own tokens and text."""
    found = Findings()
    me = record.call_id
    out = list(record.output_token_ids or ())
    prompt = record.prompt_token_ids
    if record.ids_source == "upstream":  # the no-ids fallback checks its own counts
        if record.count_check == "mismatch" or COUNT_MISMATCH in record.fidelity_flags:
            usage = record.usage_completion_tokens
            at = min(len(out), usage if isinstance(usage, int) else len(out))
            detail = {"part": "output", "ids": len(out), "usage": usage, "position": at}
            detail.update(_tail(tok, out, at))
            found.add(COUNT_MISMATCH, me, detail)
        usage_prompt = record.usage_prompt_tokens
        if prompt is not None and isinstance(usage_prompt, int) and usage_prompt != len(prompt):
            at = min(len(prompt), usage_prompt)
            detail = {"part": "prompt", "ids": len(prompt), "usage": usage_prompt, "position": at}
            detail.update(_tail(tok, prompt, at))
            found.add(PROMPT_COUNT_MISMATCH, me, detail)  # the fallback's name for it
    if record.constrained_from is not None and record.constrained_from < len(out):
        found.add(
            CONSTRAINED_SAMPLING,
            me,
            {
                "part": "output",
                "reasons": list(record.constrained_by),
                "position": record.constrained_from,
                "tokens": len(out) - record.constrained_from,
            },
        )
    if tok is None:
        return found
    if out and record.ids_source == "upstream":
        again, causes, wrong = roundtrip(tok, out)
        for cause in causes:
            if cause.flag not in found.flags:
                detail = {
                    "part": "output",
                    "turn_call_id": me,
                    "position": cause.offset,
                    "offset": cause.offset,
                    "stretches": len(causes),
                    "wrong": wrong,
                }
                detail.update(context(tok, out, again, cause.offset, cause.other_offset))
                found.add(cause.flag, me, detail)
        if wrong:
            found.wrong[me] = wrong
    if SPECIAL_TOKENS not in found.flags and record.request_json:
        text = record.request_json
        pattern = tok.special_pattern
        hits = [(m.start(), m.group(0)) for m in pattern.finditer(text)] if pattern else []
        if hits:
            offset, token = hits[0]
            found.add(
                SPECIAL_TOKENS,
                me,
                {
                    "part": "prompt",
                    "token": token,
                    "occurrences": len(hits),
                    "text": text[max(0, offset - _SNIPPET) : offset + len(token) + _SNIPPET],
                },
            )
    return found


def _tail(tok: PolicyTokenizer | None, ids: Sequence[int], at: int) -> dict[str, Any]:
    last = list(ids[max(0, at - CONTEXT) : at])
    return {"before": tok.token_strs(last)} if tok is not None else {"before_ids": last}


def rerender_checks(
    tok: PolicyTokenizer | None, job: RerenderJob, prompt: Sequence[int], found: Findings
) -> None:
    """Explain a ``rerender`` break: walk the parent's turns from the first difference on,
    find each in the new prompt, and say how the re-rendered turn differs from the sampled
    one. Adds ``template_rerender`` (its position: the common prefix) and the causes."""
    chain_at = job.lcp - job.base
    detail: dict[str, Any] = {
        "position": job.lcp,
        "parent_trace_id": job.parent_trace_id,
        "turn_call_id": job.turns[0][0],
        "in": job.where,
    }
    detail.update(context(tok, job.tokens, prompt[job.base :], chain_at, chain_at))
    turns: list[dict[str, Any]] = []
    cursor = job.lcp
    for idx, (cid, start, out_start, end) in enumerate(job.turns):
        seg = out_start  # where the compared stretch starts (the turn's output, usually)
        where = "policy"
        if idx == 0 and job.where == "env":
            if out_start - job.lcp <= BOUNDARY:
                seg, where = job.lcp, "boundary"
            else:
                turns.append({"turn_call_id": cid, "in": "env", "position": job.lcp, "wrong": 0})
        lead = out_start - seg  # environment tokens in front of the sampled turn
        sampled = job.tokens[seg - job.base : end - job.base]
        if idx == 0 and (job.where == "policy" or where == "boundary"):
            r_start = seg  # the prompt equals the chain up to the common prefix
        else:
            env = job.tokens[max(start, job.base) - job.base : out_start - job.base]
            anchor = env[-ANCHOR:]
            at = find_ids(prompt, anchor, cursor) if anchor else cursor
            if at is None:  # the environment turn itself changed: stop aligning here
                detail["unaligned_from"] = cid
                break
            r_start = at + len(anchor)
        if not sampled:
            cursor = r_start
            continue
        stop = find_ids(prompt, sampled[-1:], r_start)
        r_end = stop + 1 if stop is not None else len(prompt)
        other = prompt[r_start:r_end]
        drift = classify_turn(tok, sampled, other, lead)
        cursor = r_end
        if drift is None:
            continue
        if drift.wrong:
            found.wrong[cid] = max(found.wrong.get(cid, 0), drift.wrong)
        turns.append(
            {
                "turn_call_id": cid,
                "in": where,
                "offset": drift.offset - lead,
                "position": r_start + drift.other_offset,
                "wrong": drift.wrong,
                "causes": [c.flag for c in drift.causes],
            }
        )
        for cause in drift.causes:
            if cause.flag == TEMPLATE_RERENDER:
                continue
            d = {
                "turn_call_id": cid,
                "position": r_start + cause.other_offset,
                "offset": cause.offset - lead,
                "parent_trace_id": job.parent_trace_id,
            }
            if cause.note:
                d["note"] = cause.note
            d.update(context(tok, sampled, other, cause.offset, cause.other_offset))
            found.add(cause.flag, cid, d)
    detail["turns"] = turns
    detail["wrong"] = sum(t["wrong"] for t in turns)
    found.flags[TEMPLATE_RERENDER] = detail
    found.turns[TEMPLATE_RERENDER] = [t["turn_call_id"] for t in turns] or [job.turns[0][0]]


def apply_findings(record: CallRecord, found: Findings, mode: str, tokenizer: str | None) -> None:
    """Put the findings on the record: flags, ``fidelity_json``, and in strict mode
    ``trainable = False`` for a flagged call."""
    data = record.fidelity_data()
    data["checked"] = {"mode": mode, "tokenizer": tokenizer}
    if found.error:
        data["checked"]["error"] = found.error
    data["policy_tokens"] = len(record.output_token_ids or ())
    for flag, detail in found.flags.items():
        record.flag(flag)
        data[flag] = detail
    if found.wrong:
        data["wrong_tokens"] = found.wrong
    record.fidelity_json = json.dumps(data, ensure_ascii=False)
    if mode == STRICT and any(f in DRIFT_FLAGS for f in found.flags):
        record.trainable = False


# -- the stage -----------------------------------------------------------------------------------

# What takes a checked record on (the pipeline's next steps): returns the store's receipts.
Then = Callable[[Findings], list[Any]]


class FidelityStage:
    """The checks of finished calls: inline when there is no event loop or nothing to wait
    for, else in one worker thread. Knows nothing of the merge or the store: `check` gets the
    merge's evidence (a `RerenderJob`) and `then`, the steps that take the checked record on."""

    def __init__(self) -> None:
        self.mode = CHECK
        self.tokenizer: PolicyTokenizer | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: set[asyncio.Task] = set()
        self.checked = 0
        self.skipped = 0

    def configure(self, mode: str, tokenizer: PolicyTokenizer | None) -> None:
        self.mode = mode
        self.tokenizer = tokenizer

    @property
    def strict_flags(self) -> frozenset[str]:
        """The flags that make a rollout's traces untrainable (strict mode's drifts)."""
        return DRIFT_FLAGS if self.mode == STRICT else frozenset()

    def wants(self, record: CallRecord) -> bool:
        """Whether the record is checked at all: completed, upstream, with ids, checks on."""
        return self.mode != OFF and _checkable(record)

    def check(self, record: CallRecord, job: RerenderJob | None, then: Then) -> Any:
        """Check the record, put the findings on it, then `then(findings)`. Returns a receipt:
        done once `then`'s receipts are (the store has the record), so a durable reply's last
        bytes wait for the checks and the journal, not just the journal."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller (tests, tools): check inline
            return one_receipt(self._finish(record, self.compute(record, job), then))
        if job is None and self.tokenizer is None and not self._pending:
            # Without a tokenizer and a re-render to explain, the checks are a few counts:
            # inline, in order (nothing is waiting), since the worker's round trip costs the
            # event loop more than they do.
            return one_receipt(self._finish(record, self.compute(record, None), then))
        if len(self._pending) >= MAX_PENDING:
            self.skipped += 1
            found = Findings(error=f"skipped: {MAX_PENDING} calls already waiting for checks")
            return one_receipt(self._finish(record, found, then))
        task = loop.create_task(self._run(loop, record, job, then))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return _receipt_of(task)

    async def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        record: CallRecord,
        job: RerenderJob | None,
        then: Then,
    ) -> list[Any]:
        found = Findings(error="the proxy shut down before the checks ran")
        try:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="polar-fidelity"
                )
            found = await loop.run_in_executor(self._executor, self.compute, record, job)
        finally:
            receipts = self._finish(record, found, then)
        return receipts

    def compute(self, record: CallRecord, job: RerenderJob | None) -> Findings:
        """All checks of one call (blocking; runs in the worker thread)."""
        tok = self.tokenizer
        try:
            if tok is None:
                return self._compute(None, record, job)
            with tok.lock:
                return self._compute(tok, record, job)
        except Exception as e:  # a tokenizer failure must not lose the record
            log.exception("polar-mitm: fidelity checks of call %s failed", record.call_id)
            return Findings(error=f"{type(e).__name__}: {e}")

    @staticmethod
    def _compute(
        tok: PolicyTokenizer | None, record: CallRecord, job: RerenderJob | None
    ) -> Findings:
        found = local_checks(tok, record)
        if job is not None and record.prompt_token_ids is not None:
            rerender_checks(tok, job, record.prompt_token_ids, found)
        return found

    def _finish(self, record: CallRecord, found: Findings, then: Then) -> list[Any]:
        try:
            apply_findings(
                record, found, self.mode, self.tokenizer.spec if self.tokenizer else None
            )
            self.checked += 1
        except Exception:
            log.exception(
                "polar-mitm: applying fidelity findings to call %s failed", record.call_id
            )
        return then(found)

    async def drain(self) -> None:
        """Wait for every check in flight (at shutdown, before the rollouts are written)."""
        await drain_tasks(self._pending)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


async def _wait_receipts(task: asyncio.Task) -> None:
    receipts = await task
    if receipts:
        await asyncio.gather(*(awaitable(r) for r in receipts))


def _receipt_of(task: asyncio.Task) -> asyncio.Task:
    """Done once the checks ran and the store has journaled the record."""
    return asyncio.get_running_loop().create_task(_wait_receipts(task))


def _checkable(record: CallRecord) -> bool:
    return (
        record.status == "completed"
        and record.route != "local"
        and (record.prompt_token_ids is not None or bool(record.output_token_ids))
    )


def describe(mode: str, tokenizer: PolicyTokenizer | None) -> str:
    """One phrase for the start-up line."""
    if mode == OFF:
        return "fidelity checks off"
    if tokenizer is None:
        return f"fidelity {mode} (token positions only: set polar_tokenizer for causes)"
    return f"fidelity {mode} with {tokenizer.spec}"
