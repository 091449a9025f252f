"""The rollouts a proxy is capturing: their merged chains, how they end, and their trace rows.

Each finished call goes to its rollout's `Merger` (`Rollouts.call_finished`, a step of the call's
pipeline, `addons/pipeline.py`). A rollout ends when the control plane says so (with a reward
and a status), after an idle timeout, or at shutdown (status ``incomplete``); its traces are
written then, one row per chain. Ending a rollout that has already ended (a reward that arrives
late) writes the same trace ids again with a higher ``revision``; readers keep the highest. A call that arrives for a rollout id after it
ended opens a new rollout under the same id (its traces get new trace ids).

Calls that did not complete (``error``, ``client_aborted``, ``incomplete``) are not merged: the
harness never saw their output as an action, and a retry would only break off from it. They are
counted, and an errored one makes the rollout untrainable (`trajectory.untrainable_reasons`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..core.record import CallRecord, now_us
from ..tokens.drift import trace_summary
from .merge import CallFacts, Merger, Placement
from .rows import TraceMeta, trace_row, untrainable_reasons

log = logging.getLogger(__name__)
STATUSES = ("completed", "incomplete", "error")


class RolloutError(ValueError):
    """A control request about a rollout cannot be done; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class Rollout:
    def __init__(
        self,
        rollout_id: str,
        group_id: str | None,
        sample_index: int | None,
        proxy_id: str | None,
        now: float,
    ) -> None:
        self.rollout_id = rollout_id
        self.group_id = group_id
        self.sample_index = sample_index
        self.proxy_id = proxy_id
        self.merger = Merger()
        self.calls: list[CallFacts] = []
        self.unmerged: list[tuple[str, str]] = []  # (call_id, why it is in no trace)
        self.opened_at = now_us()
        self.last_activity = now
        self.state = "open"
        self.status: str | None = None
        self.reward: float | None = None
        self.revision = -1
        self.ended_at: int | None = None

    def add(self, record: CallRecord, now: float) -> Placement | None:
        self.last_activity = now
        facts = CallFacts(
            call_id=record.call_id,
            status=record.status,
            ids_source=record.ids_source,
            flags=tuple(record.fidelity_flags),
            policy_version=record.policy_version,
            policy_version_end=record.policy_version_end,
            error=record.error,
            trainable=record.trainable,
            rollout_source=record.rollout_source,
            constrained_from=record.constrained_from,
        )
        self.calls.append(facts)
        if record.status != "completed":
            self.unmerged.append((record.call_id, f"status {record.status}"))
            return None
        if record.prompt_token_ids is None:
            self.unmerged.append((record.call_id, f"no token ids (ids_source={record.ids_source})"))
            return None
        try:
            placement = self.merger.add(
                record.prompt_token_ids,
                record.output_token_ids,
                record.output_logprobs,
                facts=facts,
                purpose=record.purpose,
                request_json=record.request_json,
                agent=record.agent,
            )
        except ValueError as e:
            self.unmerged.append((record.call_id, f"no token ids (unusable: {e})"))
            return None
        record.delta_base = placement.base  # the store keeps only what this call adds
        return placement

    def rows(
        self, allow: frozenset[str], strict: frozenset[str] = frozenset()
    ) -> list[dict[str, Any]]:
        meta = TraceMeta(
            rollout_id=self.rollout_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            proxy_id=self.proxy_id,
            reward=self.reward,
            status=self.status or "incomplete",
            revision=max(self.revision, 0),
            created_at=self.ended_at or now_us(),
        )
        return [
            trace_row(
                chain,
                meta,
                untrainable_reasons(chain.calls, self.calls, allow, self.unmerged, strict),
                trace_summary(chain.calls, self.calls),
            )
            for chain in self.merger.chains
        ]

    def summary(
        self, allow: frozenset[str] = frozenset(), strict: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        chains = self.merger.chains
        reasons = untrainable_reasons((), self.calls, allow, self.unmerged, strict)
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "state": self.state,
            "status": self.status,
            "reward": self.reward,
            "revision": self.revision if self.revision >= 0 else None,
            "calls": len(self.calls),
            "unmerged_calls": len(self.unmerged),
            "traces": len(chains),
            "roles": {r: sum(1 for c in chains if c.role == r) for r in ("main", "sub", "side")},
            "policy_tokens": sum(c.policy_tokens for c in chains),
            "policy_versions": sorted(
                {v for c in self.calls for v in (c.policy_version, c.policy_version_end) if v}
            ),
            "trainable": not reasons,
            "untrainable_reason": "; ".join(reasons) or None,
            "opened_at": self.opened_at,
            "ended_at": self.ended_at,
        }


class Rollouts:
    """Open and recently ended rollouts; the trajectory side of the control plane."""

    def __init__(
        self,
        write: Callable[[list[dict[str, Any]]], None],
        proxy_id: str | None = None,
        keep_ended: int = 64,
        allow: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write = write
        self.proxy_id = proxy_id
        self.keep_ended = keep_ended
        self.allow = allow
        self.clock = clock
        # drift flags that make a whole rollout untrainable (polar_fidelity=strict)
        self.strict: frozenset[str] = frozenset()
        self.open: dict[str, Rollout] = {}
        self.ended: OrderedDict[str, Rollout] = OrderedDict()

    # -- calls ----------------------------------------------------------------------------------

    def call_finished(self, record: CallRecord) -> tuple[Rollout, Placement | None]:
        """Merge the call into its rollout; returns the rollout and where the call went."""
        rollout = self.open.get(record.rollout_id)
        if rollout is None:
            rollout = Rollout(
                record.rollout_id, record.group_id, record.sample_index, self.proxy_id, self.clock()
            )
            self.open[record.rollout_id] = rollout
        return rollout, rollout.add(record, self.clock())

    def rewrite(self, rollout: Rollout) -> None:
        """Write an ended rollout's traces again, as a new revision: what its calls say changed
        after it ended (fidelity findings that arrived late)."""
        if rollout.state != "ended":
            return
        rollout.revision += 1
        rows = rollout.rows(self.allow, self.strict)
        if rows:
            self.write(rows)

    # -- ending ---------------------------------------------------------------------------------

    def end(
        self, rollout_id: str, *, reward: float | None = None, status: str = "completed"
    ) -> Rollout:
        """End a rollout (or re-end an ended one with a new reward) and write its traces."""
        if status not in STATUSES:
            raise RolloutError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, int | float):
                raise RolloutError("reward must be a number or null")
            if not math.isfinite(reward):
                raise RolloutError("reward must be finite")
            reward = float(reward)
        rollout = self.open.pop(rollout_id, None)
        if rollout is None:
            rollout = self.ended.get(rollout_id)
            if rollout is None:
                raise RolloutError(f"no rollout {rollout_id!r} is open or recently ended", 404)
        rollout.state = "ended"
        rollout.status = status
        rollout.reward = reward
        rollout.revision += 1
        rollout.ended_at = now_us()
        self.ended[rollout_id] = rollout
        self.ended.move_to_end(rollout_id)
        while len(self.ended) > self.keep_ended:
            self.ended.popitem(last=False)
        rows = rollout.rows(self.allow, self.strict)
        if rows:
            self.write(rows)
        log.info(
            "polar-mitm: rollout %s ended (%s, reward %s): %d trace(s), revision %d",
            rollout_id,
            status,
            reward,
            len(rows),
            rollout.revision,
        )
        return rollout

    def end_idle(
        self, idle_s: float, busy: Callable[[str], bool], not_before: float = 0.0
    ) -> list[str]:
        """End, as completed, the open rollouts without a call for `idle_s` and none in flight;
        the idle time counts from `not_before` at the earliest (the end of a pause)."""
        now = self.clock()
        stale = [
            r.rollout_id
            for r in self.open.values()
            if now - max(r.last_activity, not_before) >= idle_s and not busy(r.rollout_id)
        ]
        for rollout_id in stale:
            self.end(rollout_id, status="completed")
        return stale

    def close(self) -> int:
        """Shutdown: write every open rollout as incomplete."""
        ids = list(self.open)
        for rollout_id in ids:
            self.end(rollout_id, status="incomplete")
        return len(ids)

    # -- reading --------------------------------------------------------------------------------

    def get(self, rollout_id: str) -> Rollout | None:
        return self.open.get(rollout_id) or self.ended.get(rollout_id)

    def listing(self, group: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        rollouts = [*self.ended.values(), *self.open.values()]
        return [
            r.summary(self.allow, self.strict)
            for r in rollouts
            if (group is None or r.group_id == group) and (state is None or r.state == state)
        ]

    def groups(self) -> list[dict[str, Any]]:
        """GRPO groups (rollout ids `<group>.<sample>`) and their samples."""
        groups: dict[str, dict[str, Any]] = {}
        for r in [*self.ended.values(), *self.open.values()]:
            if r.group_id is None:
                continue
            g = groups.setdefault(
                r.group_id, {"group_id": r.group_id, "samples": {}, "open": 0, "ended": 0}
            )
            g["samples"][str(r.sample_index)] = {
                "rollout_id": r.rollout_id,
                "state": r.state,
                "status": r.status,
                "reward": r.reward,
            }
            g[r.state] += 1
        for g in groups.values():
            g["samples"] = dict(sorted(g["samples"].items(), key=lambda kv: int(kv[0])))
            g["size"] = len(g["samples"])
        return sorted(groups.values(), key=lambda g: g["group_id"])

    def traces_json(self, rollout_id: str) -> dict[str, Any]:
        rollout = self.get(rollout_id)
        if rollout is None:
            raise RolloutError(f"no rollout {rollout_id!r} is open or recently ended", 404)
        return {
            "rollout": rollout.summary(self.allow, self.strict),
            "traces": [_jsonable(r) for r in rollout.rows(self.allow, self.strict)],
        }


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()}
