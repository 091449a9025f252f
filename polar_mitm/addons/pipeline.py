"""`CallPipeline`: what happens to a finished call, in order, in one place.

The capture path hands every finished record to one sink, this one; its steps are listed in
`call_finished` in the order they run:

1. the control state stamps ``policy_version_end`` (and counts the call out of those in flight),
   before anything below sees the record;
2. the merge puts the call into its rollout's chains (`trajectory/rollouts.py`, on the event
   loop: microseconds) and says where it went;
3. the fidelity checks (`tokens/fidelity.py`) run, on a worker thread when there is an event
   loop, with the merge's evidence of a ``rerender`` break;
4. their findings go back into the rollout's facts (a rollout that ended while the checks ran is
   written again, as a new revision);
5. the final sinks get the checked record: the store (whose receipt is the journal's fsync) and
   the metrics.

Each step is guarded: a bug in one is logged and the record still reaches the store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..control import ControlState
from ..core.record import CallRecord, CallSink, deliver, one_receipt
from ..tokens.drift import CONTEXT
from ..tokens.fidelity import FidelityStage, Findings, RerenderJob
from ..tokens.tokenizer import PolicyTokenizer
from ..trajectory.breaks import RERENDER
from ..trajectory.merge import CallFacts, Chain, Placement
from ..trajectory.rollouts import Rollout, Rollouts

log = logging.getLogger("polar_mitm")


class Merged:
    """Where the merge put one call: its rollout, its placement, and its facts there."""

    __slots__ = ("facts", "placement", "rollout")

    def __init__(self, rollout: Rollout, placement: Placement | None) -> None:
        self.rollout = rollout
        self.placement = placement
        self.facts: CallFacts | None = rollout.calls[-1] if rollout.calls else None


class CallPipeline:
    """The steps of a finished call (see the module docstring); a `CallSink` whose receipt is
    the store's, after the checks."""

    def __init__(
        self,
        *,
        control: ControlState | None,
        rollouts: Rollouts,
        checks: FidelityStage,
        final: Sequence[CallSink],
    ) -> None:
        self.control = control
        self.rollouts = rollouts
        self.checks = checks
        self.final = list(final)

    def configure_checks(self, mode: str, tokenizer: PolicyTokenizer | None) -> None:
        """`polar_fidelity` and the tokenizer; strict mode's flags make traces untrainable."""
        self.checks.configure(mode, tokenizer)
        self.rollouts.strict = self.checks.strict_flags

    def call_finished(self, record: CallRecord) -> Any:
        self._stamp(record)
        merged = self._merge(record)
        if not self.checks.wants(record):
            return one_receipt(self._store(record))
        job = _rerender_job(merged) if merged is not None else None
        return self.checks.check(record, job, lambda found: self._checked(record, merged, found))

    # -- the steps -------------------------------------------------------------------------------

    def _stamp(self, record: CallRecord) -> None:
        if self.control is None:
            return
        try:
            self.control.call_finished(record)
        except Exception:
            log.exception("polar-mitm: stamping call %s failed", record.call_id)

    def _merge(self, record: CallRecord) -> Merged | None:
        try:
            return Merged(*self.rollouts.call_finished(record))
        except Exception:  # a merge bug must not keep the record from the store
            log.exception("polar-mitm: merging call %s failed", record.call_id)
            return None

    def _checked(self, record: CallRecord, merged: Merged | None, found: Findings) -> list[Any]:
        """After the checks: the findings into the rollout's facts, then the final sinks."""
        facts = merged.facts if merged is not None else None
        if facts is not None:
            try:
                facts.flags = tuple(record.fidelity_flags)
                facts.trainable = record.trainable
                facts.fidelity = {"wrong": dict(found.wrong), "turns": dict(found.turns)}
                if merged.rollout.state == "ended":
                    self.rollouts.rewrite(merged.rollout)  # it ended while the checks ran
            except Exception:
                log.exception(
                    "polar-mitm: applying fidelity findings to call %s failed", record.call_id
                )
        return self._store(record)

    def _store(self, record: CallRecord) -> list[Any]:
        return deliver(record, self.final)


def _rerender_job(merged: Merged) -> RerenderJob | None:
    """The merge's evidence of a ``rerender`` break, copied on the event loop (the chain goes on
    growing while the worker checks): None for any other placement."""
    placement = merged.placement
    if placement is None or placement.break_reason != RERENDER:
        return None
    chain = _parent(merged.rollout, placement)
    return rerender_job(chain, placement.prefix_len) if chain is not None else None


def rerender_job(chain: Chain, lcp: int) -> RerenderJob | None:
    """The evidence to explain a break off `chain` at common prefix `lcp` (None: nothing of
    the chain differs, e.g. the prompt extends all of it)."""
    i, where = chain.locate(lcp)
    if where not in ("policy", "env") or i < 0:
        return None
    n = len(chain.calls)
    turns = []
    for j in range(i, n):
        end = chain.call_offsets[j + 1] if j + 1 < n else len(chain)
        turns.append((chain.calls[j].call_id, chain.call_offsets[j], chain.output_offsets[j], end))
    base = min(chain.call_offsets[i], max(0, lcp - CONTEXT))
    return RerenderJob(
        parent_trace_id=chain.trace_id,
        lcp=lcp,
        base=base,
        tokens=chain.tokens[base:],
        turns=turns,
        where=where,
    )


def _parent(rollout: Rollout, placement: Placement) -> Chain | None:
    for chain in reversed(rollout.merger.chains):
        if chain.trace_id == placement.parent_trace_id:
            return chain
    return None
