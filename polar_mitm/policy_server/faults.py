"""Fault modes: the one place where a scripted turn's ``fault`` field changes what is sent.

A fault is a function ``(spec, plan) -> plan`` over the finished :class:`ReplyPlan` (status, headers and
the exact bytes of every event), registered in :data:`FAULTS` under the name a scenario uses::

    {"content": "...", "fault": "drop_usage"}                 # a bare name
    {"content": "...", "fault": {"mode": "stall", "after": 3}} # a name with parameters

Because faults rewrite data rather than patch the server, a new mode is one function here (plus,
for modes that need the connection itself, such as an abort, one field on :class:`ReplyPlan` that
the server honours). No modes are defined yet; unknown ones are logged once and ignored so scenario
files written for a newer server still play.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .wire import ReplyPlan

log = logging.getLogger(__name__)

FaultFn = Callable[[dict[str, Any], ReplyPlan], ReplyPlan]

#: Fault modes by name. Empty for now (reserved in the scenario format).
FAULTS: dict[str, FaultFn] = {}

_warned: set[str] = set()


def fault_spec(raw: Any) -> dict[str, Any] | None:
    """Normalize a turn's ``fault`` field to ``{"mode": name, ...}`` (``None`` for no fault)."""
    if raw is None or raw is False or raw == "":
        return None
    if isinstance(raw, str):
        return {"mode": raw}
    if isinstance(raw, dict) and isinstance(raw.get("mode"), str):
        return dict(raw)
    return {"mode": repr(raw)}


def apply_fault(raw: Any, plan: ReplyPlan) -> ReplyPlan:
    """Apply the turn's fault (if any) to the plan about to be sent."""
    spec = fault_spec(raw)
    if spec is None:
        return plan
    fn = FAULTS.get(spec["mode"])
    if fn is None:
        if spec["mode"] not in _warned:
            _warned.add(spec["mode"])
            log.warning("unknown fault mode %r ignored", spec["mode"])
        return plan
    return fn(spec, plan)
