"""A merged chain as a `traces/` row (`trace_row`), and whether it is trainable
(`untrainable_reasons`): read from the chain's arrays in place, when a rollout's traces are
written (`rollouts.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .merge import CallFacts, Chain

ALLOW_CHOICES = ("policy_mixed", "call_error", "anonymous")
ANONYMOUS_SOURCE = "client_address"  # call.identity.CLIENT_ADDRESS: no id but the client address


def untrainable_reasons(
    chain_calls: Sequence[CallFacts],
    rollout_calls: Sequence[CallFacts],
    allow: frozenset[str] = frozenset(),
    unmerged: Sequence[tuple[str, str]] = (),
    strict: frozenset[str] = frozenset(),
) -> list[str]:
    """Why a trace must not be trained on; empty when it may.

    Rollout-wide: its calls ran under more than one policy version (``policy_mixed``), one of
    them errored (``call_error``), its id is the client address alone, which every session from
    that address shares (``anonymous``) — each waived when `allow` names it (ALLOW_CHOICES) — or a
    completed call has no token ids, so its sampled tokens are missing from the traces
    (``ids_missing``), or, with ``polar_fidelity=strict`` (`strict` holds the drift flags), a
    call of the rollout carries one of them (``fidelity_strict``). Per trace: a call the capture
    path found untrainable (ids not from the upstream, unless ``polar_trust_retokenized``
    vouched for them; fidelity flags).
    """
    reasons: list[str] = []
    versions: list[str | None] = []
    for c in rollout_calls:
        for v in (c.policy_version, c.policy_version_end):
            if v not in versions:
                versions.append(v)
    if len(versions) > 1 and "policy_mixed" not in allow:
        shown = ", ".join("unset" if v is None else v for v in versions)
        reasons.append(f"policy_mixed: the rollout's calls ran under {shown}")
    if "call_error" not in allow:
        for c in rollout_calls:
            if c.status == "error":
                reasons.append(f"call_error: call {c.call_id} failed: {c.error or 'error'}")
                break
    if "anonymous" not in allow:
        for c in rollout_calls:
            if c.rollout_source == ANONYMOUS_SOURCE:
                reasons.append(
                    f"anonymous: call {c.call_id} named no rollout (no polar- key, proxy "
                    "credentials, x-polar-rollout header or session id): the rollout is every "
                    "session from its client address"
                )
                break
    for call_id, why in unmerged:
        if why.startswith("no token ids"):
            reasons.append(f"ids_missing: call {call_id} is in no trace ({why})")
            break
    if strict:
        for c in rollout_calls:
            hit = [f for f in c.flags if f in strict]
            if hit:
                reasons.append(f"fidelity_strict: call {c.call_id} flagged {','.join(hit)}")
                break
    for c in chain_calls:
        if not c.trainable:
            what = [f"ids_source={c.ids_source}"] if c.ids_source != "upstream" else []
            what += [f"flagged {','.join(c.flags)}"] if c.flags else []
            reasons.append(f"call_untrainable: call {c.call_id} ({'; '.join(what) or 'capture'})")
            break
    return reasons


@dataclass(slots=True)
class TraceMeta:
    """The rollout-level columns of a trace row."""

    rollout_id: str
    group_id: str | None = None
    sample_index: int | None = None
    proxy_id: str | None = None
    reward: float | None = None
    status: str = "completed"
    revision: int = 0
    created_at: int | None = None
    extra_flags: list[str] = field(default_factory=list)


def trace_row(
    chain: Chain, meta: TraceMeta, reasons: Sequence[str], fidelity: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One `traces/` row (store.schema.TRACES_SCHEMA). The arrays are the chain's own: the
    chain must not change afterwards (the store reads them from its journal thread)."""
    versions: list[str] = []
    flags: list[str] = list(meta.extra_flags)
    for c in chain.calls:
        for v in (c.policy_version, c.policy_version_end):
            if v is not None and v not in versions:
                versions.append(v)
        for f in c.flags:
            if f not in flags:
                flags.append(f)
    policy = chain.policy_tokens
    return {
        "trace_id": chain.trace_id,
        "revision": meta.revision,
        "rollout_id": meta.rollout_id,
        "group_id": meta.group_id,
        "sample_index": meta.sample_index,
        "proxy_id": meta.proxy_id,
        "role": chain.role,
        "purpose": chain.purpose,
        "agent": chain.agent,
        "parent_trace_id": chain.parent.trace_id if chain.parent else None,
        "parent_prefix_len": chain.prefix_len,
        "break_reason": chain.break_reason,
        "break_detail": json.dumps(chain.break_detail) if chain.break_detail else None,
        "call_ids": chain.call_ids,
        "call_offsets": chain.call_offsets,
        "input_ids": chain.tokens,
        "loss_mask": chain.mask,
        "logprobs": chain.logprobs,
        "num_policy_tokens": policy,
        "num_env_tokens": len(chain) - policy,
        "policy_versions": versions,
        "fidelity_flags": flags,
        "fidelity_json": json.dumps(fidelity) if fidelity else None,
        "reward": meta.reward,
        "status": meta.status,
        "trainable": not reasons,
        "untrainable_reason": "; ".join(reasons) or None,
        "created_at": meta.created_at,
        "constrained_spans": constrained_spans(chain),
    }


def constrained_spans(chain: Chain) -> list[int] | None:
    """Flattened ``[start, end)`` pairs of the chain's tokens sampled under a grammar: each
    call's output from its ``constrained_from`` on (None: no such token)."""
    spans: list[int] = []
    for facts, (start, end) in zip(chain.calls, chain._sampled(), strict=True):
        if facts.constrained_from is not None and start + facts.constrained_from < end:
            spans += [start + facts.constrained_from, end]
    return spans or None
