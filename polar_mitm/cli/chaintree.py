"""A rollout's chains as a tree: the main chain, the chains that broke off it, and theirs.

A long session is several chains linked by `parent_trace_id`: the main agent's chain, a chain
per compaction call (purpose ``compaction``, role ``side``), the main chain after each
compaction (break reason ``compaction``), a ``sub`` chain per sub-agent. `polar-mitm summary`
and `show` draw that tree so a person sees the whole rollout at once (docs/trajectories.md,
"Lineage"). Pure functions over trace rows (dicts with the `TRACE_FIGURES` columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text
from rich.tree import Tree


def ordered(traces: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, trace) in depth-first order; roots are traces whose parent is not among them,
    siblings keep the order they were written in (the order the chains were started)."""
    ids = {t["trace_id"] for t in traces}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for t in traces:
        parent = t.get("parent_trace_id")
        children.setdefault(parent if parent in ids else None, []).append(t)
    out: list[tuple[int, dict[str, Any]]] = []
    seen: set[str] = set()

    def walk(trace: dict[str, Any], depth: int) -> None:
        if trace["trace_id"] in seen:  # a cycle cannot come from the merge; never loop on one
            return
        seen.add(trace["trace_id"])
        out.append((depth, trace))
        for child in children.get(trace["trace_id"], ()):
            walk(child, depth + 1)

    for root in children.get(None, ()):
        walk(root, 0)
    return out


def label(trace: dict[str, Any]) -> str:
    """One line about a chain: role, purpose, agent, why it broke off, size."""
    words = [trace.get("role") or "?", trace["trace_id"][:12]]
    purpose = trace.get("purpose")
    if purpose and purpose != "main":
        words.append(f"purpose {purpose}")
    if trace.get("agent"):
        words.append(f"agent {trace['agent']}")
    words.append(trace.get("break_reason") or "-")
    calls = len(trace.get("call_ids") or ())
    words.append(f"{calls} call{'s' if calls != 1 else ''}")
    words.append(f"{trace.get('num_policy_tokens') or 0} policy tokens")
    if trace.get("trainable") is False:
        words.append("untrainable")
    return "  ".join(words)


def tree(rollout_id: str, traces: Sequence[dict[str, Any]], mark: str | None = None) -> Tree:
    """The rich tree of one rollout's chains; the trace `mark` (shown by `show`) is bold."""
    root = Tree(Text(f"rollout {rollout_id}: {len(traces)} chains", style="bold"))
    stack: list[Tree] = [root]
    for depth, trace in ordered(traces):
        del stack[depth + 1 :]
        style = "bold reverse" if trace["trace_id"] == mark else ""
        stack.append(stack[-1].add(Text(label(trace), style=style)))
    return root


def tree_lines(traces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tree as JSON: one entry per chain, depth-first, with its depth."""
    return [
        {
            "depth": depth,
            "trace_id": t["trace_id"],
            "parent_trace_id": t.get("parent_trace_id"),
            "role": t.get("role"),
            "purpose": t.get("purpose"),
            "agent": t.get("agent"),
            "break_reason": t.get("break_reason"),
            "calls": len(t.get("call_ids") or ()),
            "policy_tokens": t.get("num_policy_tokens") or 0,
        }
        for depth, t in ordered(traces)
    ]
