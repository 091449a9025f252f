"""Compaction: the harness replaces its history with a summary, and the policy writes it.

Long rollouts outgrow the context; the harness then compacts. Two shapes reach the proxy:

* **Codex** (OpenAI Responses, `x-codex-beta-features: remote_compaction_v2`) asks the *server*
  to compact: an ordinary `POST /v1/responses` whose last input item is `{"type":
  "compaction_trigger"}` (older clients: `POST /v1/responses/compact`). The real API answers one
  `compaction` item with an opaque `encrypted_content`, and the client sends that item back in
  place of the compacted history. Behind polar-mitm the policy writes the summary: the request
  goes upstream as the history plus `INSTRUCTION` as a last user turn, the text the policy
  writes is sealed into the item's `encrypted_content` (`convert.seal`, the scheme reasoning
  uses: base64, not encrypted), and a `compaction` item that comes back is rendered for the
  policy as one user message, `SUMMARY_PREFIX` + the summary.
* **Claude Code** compacts by itself: an ordinary Messages call whose last user turn asks for a
  summary (`CLAUDE_COMPACT_PROMPT`), then a new conversation whose first user turn starts with
  `CLAUDE_CONTINUATION`. Nothing to answer differently; both are recognized for the lineage.

Either way the compaction call has purpose ``compaction`` (its own ``side`` chain, whose tokens
are policy tokens like any other) and the next main call starts a chain with break reason
``compaction`` whose parent is the chain before (trajectory/breaks.py, trajectory/merge.py).
"""

from __future__ import annotations

from typing import Any

PURPOSE = "compaction"
TRIGGER = "compaction_trigger"
# The item types the Responses API uses for a compacted history (`compaction_summary` is the
# older name some clients still send).
ITEM_TYPES = frozenset({"compaction", "compaction_summary"})

# What the policy is asked: a summary it can continue from, in plain text, because that text is
# all that is left of the history once the harness has compacted it.
INSTRUCTION = (
    "Your context window is full, so the conversation so far is about to be replaced by a "
    "summary that you write now. Write it for yourself, to continue the task from it alone: "
    "the task and every requirement the user gave; what has been done so far (files created or "
    "changed, commands run and what they showed); what is left to do, and the very next step. "
    "Be complete but brief. Answer with the summary only, as plain text; do not call any tool."
)
# How a compaction item is shown to the policy in later requests.
SUMMARY_PREFIX = "Summary of the conversation so far (the earlier turns were compacted):\n\n"

# Claude Code 2.1's own compaction (the text of its prompt and of its continuation message).
CLAUDE_COMPACT_PROMPT = "Your task is to create a detailed summary of the conversation so far"
CLAUDE_CONTINUATION = "This session is being continued from a previous conversation"


class CompactionError(ValueError):
    """A compaction item polar-mitm cannot render (not one of its own)."""


def is_trigger(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == TRIGGER


def is_summary_item(item: Any) -> bool:
    # a frozenset lookup of a JSON value: an unhashable "type" (a list, an object) is no match
    return (
        isinstance(item, dict) and isinstance(item.get("type"), str) and item["type"] in ITEM_TYPES
    )


def summary_message(summary: str | None) -> str:
    """The user message a compaction item becomes for the policy; `summary` is its unsealed
    `encrypted_content` (None: not one we sealed).

    Only our own sealed summaries can be read: the real API's are ciphertext, which no policy
    can be shown (a history compacted by OpenAI cannot continue behind polar-mitm)."""
    if summary is None:
        raise CompactionError(
            "a compaction item whose encrypted_content polar-mitm did not write (the real API's "
            "is ciphertext no policy can read); compact the history again through polar-mitm"
        )
    return SUMMARY_PREFIX + summary


def is_claude_compaction(last_user_text: str) -> bool:
    """Claude Code's own compaction call (its last user turn asks for the summary)."""
    return CLAUDE_COMPACT_PROMPT in last_user_text


def is_continuation(text: str) -> bool:
    """A message that carries a compacted history: our rendered summary, or Claude Code's."""
    return text.startswith(SUMMARY_PREFIX) or text.lstrip().startswith(CLAUDE_CONTINUATION)
