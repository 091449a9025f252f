"""What chat mode would have sent for each token-in call of a capture (`polar-mitm fidelity`).

Exact-prefix mode sends a call as its chain's tokens plus only the new messages; the drift it
removed is how chat mode's prompt (the whole conversation rendered with the chat template and
tokenized) differs from that. Computing chat mode's prompt is O(conversation) per call — a long
agent session's last call is 80k tokens, a quarter of a second of tokenizing — so the proxy does
not do it on every call; this report does it once, from the stored request (parsed again by its
dialect, normalized as its upstream kind would) and the prompt ids that were sent, with the
tokenizer the proxy recorded with its shards (`tokenizer_record`) or ``--tokenizer``.
"""

from __future__ import annotations

import json
from typing import Any

from ..dialects import by_name
from ..tokens.tokenizer import PolicyTokenizer
from ..trajectory.exact_prefix import chat_prompt_ids, prompt_drift
from ..upstream import UPSTREAMS

# The calls columns the comparison reads (besides what the report reads anyway).
COLUMNS = ("route", "dialect", "path", "upstream_kind", "request_json", "prompt_token_ids")


def needs_drift(row: dict[str, Any]) -> bool:
    """A token-in call whose record does not say yet what chat mode would have sent."""
    if row.get("route") != "token_in":
        return False
    note = _note(row)
    return note is not None and note.get("path") == "token_in" and "drift_tokens" not in note


def fill_drift(rows: list[dict[str, Any]], tok: PolicyTokenizer) -> int:
    """Put `prompt_drift` (or `chat_prompt_error`) into each such row's
    ``fidelity_json["exact_prefix"]``; how many rows were compared."""
    done = 0
    for row in rows:
        if not needs_drift(row):
            continue
        data = json.loads(row["fidelity_json"])
        note = data["exact_prefix"]
        try:
            chat = _chat_body(row)
            kind = UPSTREAMS.get(row.get("upstream_kind") or "vllm")
            flavor = kind.template_flavor if kind is not None else "vllm"
            would = chat_prompt_ids(tok, flavor, chat)
        except Exception as e:  # one unreadable request must not end the report
            note["chat_prompt_error"] = f"{type(e).__name__}: {e}"
        else:
            note.update(prompt_drift(row.get("prompt_token_ids") or (), would))
        row["fidelity_json"] = json.dumps(data, ensure_ascii=False)
        done += 1
    return done


def _note(row: dict[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(row.get("fidelity_json") or "{}")
    except ValueError:
        return None
    note = data.get("exact_prefix") if isinstance(data, dict) else None
    return note if isinstance(note, dict) else None


def _chat_body(row: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body the call's dialect made of the stored request."""
    dialect = by_name(row.get("dialect") or "openai_chat")
    body = (row.get("request_json") or "{}").encode()
    return dialect.parse(body, row.get("path") or "").chat
