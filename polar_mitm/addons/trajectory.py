"""`TrajectoryAddon`: merges each rollout's calls into traces, writes them when the rollout ends."""

from __future__ import annotations

import asyncio

from mitmproxy import ctx

from ..control import ControlState
from ..trajectory.rollouts import Rollouts
from ..trajectory.rows import ALLOW_CHOICES
from .exact_prefix import ExactPrefixAddon
from .options import _errors, _seconds, log
from .store import StoreAddon


class TrajectoryAddon:
    """Each rollout's calls, prefix-merged into chains (`trajectory/merge.py`: the call's pipeline,
    `addons/pipeline.py`, merges each finished call into `rollouts`); their `traces/` rows are
    written when the rollout ends: by the control plane, after `polar_rollout_idle`
    seconds without a call, or at shutdown (as `incomplete`)."""

    def __init__(
        self, store: StoreAddon, control: ControlState, exact: ExactPrefixAddon | None = None
    ) -> None:
        self.store = store
        self.control = control
        self.exact = exact
        self.rollouts = Rollouts(self._write)
        self.idle_s = 0.0
        self._idle_task: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_rollout_idle",
            str,
            "0",
            "End a rollout (status completed, no reward) after this many seconds without a call "
            "and none in flight; its traces are written then. 0: only the control plane or "
            "shutdown end rollouts. A reward sent later writes a new revision of its traces.",
        )
        loader.add_option(
            "polar_train_allow",
            str,
            "",
            "Comma-separated rollout conditions that do not make its traces untrainable: "
            "policy_mixed (its calls ran under several policy versions), call_error (one of its "
            "calls failed), anonymous (its id is the client address alone: allow it only with "
            "one container per rollout). Retokenized ids: see polar_trust_retokenized.",
        )
        loader.add_option(
            "polar_keep_ended",
            int,
            64,
            "Ended rollouts kept in memory for the control plane (listing, traces, late rewards).",
        )

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if "polar_train_allow" in updated:
            allow = frozenset(a.strip() for a in opts.polar_train_allow.split(",") if a.strip())
            unknown = sorted(allow - set(ALLOW_CHOICES))
            if unknown:
                _errors.fail(
                    f"polar_train_allow: unknown {', '.join(unknown)} "
                    f"(choose from {', '.join(ALLOW_CHOICES)})"
                )
            else:
                self.rollouts.allow = allow
        if "polar_keep_ended" in updated:
            if opts.polar_keep_ended < 0:
                _errors.fail("polar_keep_ended: must be 0 or more")
            else:
                self.rollouts.keep_ended = opts.polar_keep_ended
        if "polar_rollout_idle" in updated:
            idle = _seconds("polar_rollout_idle", opts.polar_rollout_idle or "0")
            if idle is not None:
                self.idle_s = idle

    def running(self) -> None:
        if self.store.store is not None:
            self.rollouts.proxy_id = self.store.store.proxy_id
        if self._idle_task is None:
            self._idle_task = asyncio.get_running_loop().create_task(self._end_idle())

    def done(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            self._idle_task = None
        written = self.rollouts.close()
        if written:
            log.info("polar-mitm: wrote %d open rollout(s) as incomplete", written)

    def _write(self, rows: list[dict]) -> None:
        if self.store.store is not None:
            for row in rows:
                self.store.store.append("traces", row)
        if self.exact is not None:  # an ended rollout's chains are not needed any more
            for rollout_id in {row.get("rollout_id") for row in rows}:
                self.exact.rollout_written(str(rollout_id))

    async def _end_idle(self) -> None:
        while True:
            idle = self.idle_s
            await asyncio.sleep(min(max(idle / 4, 0.05), 1.0) if idle > 0 else 1.0)
            if idle > 0 and not self.control.paused:  # calls may be waiting at the pause
                try:
                    self.rollouts.end_idle(idle, self.control.busy, self.control.resumed_at)
                except Exception:  # a bug here must not stop later checks
                    log.exception("polar-mitm: ending idle rollouts failed")
