"""Why a call did not extend a chain: small pure functions over token and request evidence.

The merge (`trajectory/merge.py`) knows the token facts of a break: the longest common prefix with the
best parent chain, and whether the divergence lies in tokens the policy sampled or in tokens the
environment added. The request JSON tells what token evidence alone cannot: whether the system
prompt or the tool set changed (a sub-agent), and whether earlier messages were kept (so different
tokens mean the template re-rendered them), dropped (truncation) or replaced by something new
(compaction). `classify_break` combines both into one reason; every input is in `BreakEvidence`,
so a later check (fidelity drift flags) can call these functions and add to them.

Reasons, in the order they are tested:

- ``side_call``: the call's purpose is not ``main`` (titles, summaries, token counts);
- ``first_call``: no chain a main call could join exists yet;
- ``retry``: the prompt is an earlier state of the parent chain (the same prompt again);
- ``sub_agent``: the harness names another agent than the parent chain's (Codex's
  `x-codex-turn-metadata` `agent_name`, see trajectory/lineage.py);
- ``compaction``: the request carries one more compacted history than the parent's last call
  (a Codex `compaction` item, Claude Code's continuation message; see dialects/compaction.py);
- ``sub_agent``: another system prompt or tool set than the parent's last call, or a new task
  given to a chain that is itself a sub-agent;
- ``compaction``: a run of earlier messages was replaced by new ones (a summary);
- ``truncation``: earlier messages were dropped and nothing was put in their place;
- ``rerender``: the earlier messages are all still there, yet the tokens differ (template drift:
  dropped reasoning, re-split BPE, re-serialized tool arguments); without request JSON, a
  divergence inside sampled tokens says the same;
- ``other``: none of the above (e.g. an earlier message was edited).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..dialects.compaction import is_continuation, is_summary_item

FIRST_CALL = "first_call"
SIDE_CALL = "side_call"
RETRY = "retry"
SUB_AGENT = "sub_agent"
COMPACTION = "compaction"
TRUNCATION = "truncation"
RERENDER = "rerender"
OTHER = "other"
REASONS = (FIRST_CALL, SIDE_CALL, RETRY, SUB_AGENT, COMPACTION, TRUNCATION, RERENDER, OTHER)

# history_change results
KEPT = "kept"
TRUNCATED = "truncated"
COMPACTED = "compacted"
EDITED = "edited"

_SYSTEM_ROLES = ("system", "developer")
_VOLATILE_KEYS = frozenset({"cache_control"})  # Claude Code moves cache markers between calls


def is_side(purpose: str | None) -> bool:
    """Side calls (any purpose but ``main``) never join a main chain."""
    return (purpose or "main") != "main"


@dataclass(frozen=True, slots=True)
class RequestView:
    """The parts of a harness request that tell breaks apart, in a dialect-neutral form."""

    system: str
    tools: tuple[str, ...]  # sorted tool names
    messages: tuple[str, ...]  # one fingerprint per non-system message, in order
    summaries: int = 0  # messages that carry a compacted history (dialects/compaction.py)


@dataclass(frozen=True, slots=True)
class BreakEvidence:
    """Everything `classify_break` decides on."""

    purpose: str = "main"
    has_chains: bool = True  # some chain exists that a main call could have joined
    prompt_len: int = 0
    lcp: int = 0  # longest common prefix with the parent chain, in tokens
    parent_len: int = 0
    parent_role: str | None = None
    diverged_in: str | None = None  # "env" | "policy" | "end" (parent fully matched) | None
    system_changed: bool | None = None  # None: no request JSON to tell
    tools_changed: bool | None = None
    history: str | None = None  # history_change(...) or None
    first_message_changed: bool | None = None
    compacted: bool | None = None  # one more compacted history than the parent's last call
    agent_changed: bool | None = None  # the harness names another agent than the parent's


def classify_break(e: BreakEvidence) -> str:
    """One reason for a call that extends no chain (see the module docstring for the order)."""
    if is_side(e.purpose):
        return SIDE_CALL
    if not e.has_chains:
        return FIRST_CALL
    if e.lcp == e.prompt_len < e.parent_len:
        return RETRY
    if e.agent_changed:
        return SUB_AGENT
    if e.compacted:
        return COMPACTION
    if e.system_changed or e.tools_changed:
        return SUB_AGENT
    if e.parent_role == "sub" and e.first_message_changed and e.history in (COMPACTED, EDITED):
        return SUB_AGENT  # the same kind of sub-agent, given a new task
    if e.history == COMPACTED:
        return COMPACTION
    if e.history == TRUNCATED:
        return TRUNCATION
    if e.history == KEPT:
        return RERENDER
    if e.history is None and e.diverged_in == "policy":
        return RERENDER
    return OTHER


def history_change(before: Sequence[str], after: Sequence[str]) -> str:
    """How the message list `after` (this call) treats `before` (the parent's last call).

    ``kept``: `before` is a prefix of `after`. ``truncated``: some messages after the common
    prefix were dropped, the rest of `before` follows in order, nothing was put in between.
    ``compacted``: two or more messages were dropped and new ones (a summary) were added.
    ``edited``: anything else (one message changed, messages moved).
    """
    k = 0
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        k += 1
    if k == len(before):
        return KEPT
    rest = after[k:]
    old, now = set(before), set(after)
    dropped = sum(1 for m in before[k:] if m not in now)
    # truncation: after[k:] continues with a suffix before[j:] (j > k), then only new messages
    if rest and rest[0] in old:
        for j in range(k + 1, len(before)):
            if before[j] == rest[0]:
                tail = before[j:]
                if list(rest[: len(tail)]) == list(tail):
                    return TRUNCATED
                break
    if dropped >= 2 and any(m not in old for m in rest):
        return COMPACTED
    return EDITED


def request_view(request_json: str | None) -> RequestView | None:
    """A `RequestView` of a stored request body (chat completions, Anthropic Messages or
    OpenAI Responses), or None when there is none or it is not a JSON object."""
    if not request_json:
        return None
    try:
        body = json.loads(request_json)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    system: list[str] = []
    for key in ("system", "instructions"):  # Anthropic Messages, OpenAI Responses
        if body.get(key) is not None:
            system.append(_text(body[key]))
    tools: set[str] = set(_tool_names(body.get("tools")))
    items = body.get("messages")
    if items is None:
        items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages: list[str] = []
    summaries = 0
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            if item.get("type") == "additional_tools":  # Codex puts its tools in the input
                tools.update(_tool_names(item.get("tools")))
                continue
            if not messages and item.get("role") in _SYSTEM_ROLES:
                system.append(_text(item.get("content")))
                continue
            if is_summary_item(item) or (
                item.get("role") == "user" and is_continuation(_text(item.get("content")))
            ):
                summaries += 1
        messages.append(fingerprint(item))
    return RequestView("\n".join(system), tuple(sorted(tools)), tuple(messages), summaries)


def fingerprint(message: Any) -> str:
    """A digest of a message that ignores what harnesses change without changing meaning:
    cache markers, text given as a list of parts instead of a string, tool-call arguments as a
    JSON string instead of an object."""
    blob = json.dumps(_canonical(message), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in _VOLATILE_KEYS:
                continue
            if k == "content" and isinstance(v, list) and _all_text(v):
                v = _text(v)
            elif k == "arguments" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError:
                    pass
            out[k] = _canonical(v)
        return out
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _all_text(parts: list[Any]) -> bool:
    return all(
        isinstance(p, str)
        or (isinstance(p, dict) and p.get("type", "text") in ("text", "input_text", "output_text"))
        for p in parts
    )


def _text(value: Any) -> str:
    """Text of a content value: a string, or text parts joined with newlines (as vLLM does)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                texts.append(json.dumps(_canonical(part), sort_keys=True, default=str))
        return "\n".join(texts)
    return json.dumps(_canonical(value), sort_keys=True, default=str)


def _tool_names(tools: Any) -> Iterable[str]:
    if not isinstance(tools, list):
        return
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        if isinstance(name, str):
            yield name
        if isinstance(tool.get("tools"), list):  # a namespace of tools
            yield from (f"{name}.{n}" if name else n for n in _tool_names(tool["tools"]))
