"""Which agent of a harness made a call, from what the harness says about it.

Codex names every agent of a session in each request: the header `x-codex-turn-metadata` is a
JSON object whose `agent_name` is `/root` for the main agent and a path under it for an agent
that `spawn_agent` started. Token prefixes cannot tell a spawned agent from its parent when it
starts from a fork of the parent's history, and a spawned agent's call must never extend or
break off the parent's chain; so the name goes with the call (`CallRecord.agent`) and the merge
keeps each agent's calls in its own chains (trajectory.Merger.add). Claude Code names no agents:
its `Agent` sub-agents are told apart by their system prompt and tools (trajectory/breaks.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CODEX_METADATA = "x-codex-turn-metadata"
ROOT_AGENT = "/root"  # Codex's name for the main agent


def turn_metadata(headers: Mapping[str, str]) -> dict[str, Any]:
    """Codex's turn metadata header as a dict (empty when absent or not a JSON object)."""
    raw = headers.get(CODEX_METADATA)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def agent_of(headers: Mapping[str, str]) -> str | None:
    """The calling agent's name (Codex's `agent_name`), or None when the harness names none."""
    name = turn_metadata(headers).get("agent_name")
    return name if isinstance(name, str) and name else None
