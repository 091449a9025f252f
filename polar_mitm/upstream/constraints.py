"""Grammar-constrained sampling: which requests get it, and which output tokens it touched.

vLLM constrains decoding with a grammar (xgrammar structural tags over its tool-call format,
``vllm/parser/abstract_parser.py`` ``_apply_structural_tag``, ``vllm/tool_parsers/
structural_tag_registry.py``) when a request with tools has ``parallel_tool_calls: false``,
``tool_choice: "required"`` or a named function, or a ``strict: true`` tool, and when it asks a
``response_format`` other than text. The logprobs it returns for a token sampled under the grammar
are those of the masked, renormalized distribution (up to 11.8 nats from the model's own, measured
on vLLM 0.32: docs/constrained.md), so a trainer's importance ratios on those tokens are wrong.

Which tokens: with a reasoning parser (``--reasoning-parser``) the grammar starts once the
reasoning has ended: at once when the prompt's last turn already closed the think block (vLLM's
``is_reasoning_end`` on the prompt: scanning back from its end, ``</think>`` before ``<think>``
or the turn's start), else after the first ``</think>`` the model samples; it then holds to the
end of the output. Without a reasoning split the whole output is under it. The span recorded is
that stretch, ``[constrained_from, len(output))``: it covers every token whose logprob the grammar
bent (and, in ``tool_choice: auto`` requests, a few free-text tokens before the tool-call trigger
that it did not, whose logprobs are the model's own).

Only the constraint that serves the harness alone, ``parallel_tool_calls: false`` (one call per
reply, so its loop stays simple), can be left out upstream (``polar_harness_constraints=drop``);
the others change what the policy may answer at all and always go to the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: the fidelity flag of a call with grammar-constrained tokens (``polar_fidelity=strict``: the
#: rollout's traces are untrainable)
CONSTRAINED_SAMPLING = "constrained_sampling"
PASS, DROP = "pass", "drop"
MODES = (PASS, DROP)

PARALLEL_FALSE = "parallel_tool_calls=false"
TOOL_CHOICE_REQUIRED = "tool_choice=required"
TOOL_CHOICE_NAMED = "tool_choice=named"
STRICT_TOOLS = "strict_tools"
# vLLM's own request extras that constrain decoding directly
_STRUCTURED_KEYS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def constraint_reasons(body: dict[str, Any]) -> list[str]:
    """Why vLLM will sample this chat request under a grammar (empty: it will not)."""
    reasons: list[str] = []
    tools = body.get("tools") or ()
    choice = body.get("tool_choice", "auto")
    if tools and choice != "none":
        if body.get("parallel_tool_calls") is False:
            reasons.append(PARALLEL_FALSE)
        if choice == "required":
            reasons.append(TOOL_CHOICE_REQUIRED)
        elif isinstance(choice, dict):
            reasons.append(TOOL_CHOICE_NAMED)
        if any(_strict(t) for t in tools):
            reasons.append(STRICT_TOOLS)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        reasons.append(f"response_format={fmt.get('type')}")
    reasons.extend(k for k in _STRUCTURED_KEYS if body.get(k) is not None)
    return reasons


def _strict(tool: Any) -> bool:
    if not isinstance(tool, dict):
        return False
    function = tool.get("function")
    return (isinstance(function, dict) and function.get("strict") is True) or tool.get(
        "strict"
    ) is True


def without_harness_constraints(chat: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The chat body without ``parallel_tool_calls: false`` and the note saying so (None: there
    was nothing to leave out)."""
    if chat.get("parallel_tool_calls") is not False:
        return chat, None
    body = {k: v for k, v in chat.items() if k != "parallel_tool_calls"}
    return body, (
        "parallel_tool_calls=false not sent upstream (polar_harness_constraints=drop): the "
        "policy samples without the one-call grammar"
    )


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """The policy tokenizer's ids of the reasoning and turn delimiters."""

    start: int | None  # <think>
    end: int | None  # </think>
    turn: int | None  # <|im_start|>

    @classmethod
    def of(cls, specials: dict[str, int]) -> ThinkMarkers | None:
        found = cls(specials.get("<think>"), specials.get("</think>"), specials.get("<|im_start|>"))
        return found if found.end is not None else None


def constrained_from(
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int],
    markers: ThinkMarkers | None,
    reasoning_split: bool,
) -> int | None:
    """The first output token sampled under the grammar (None: none was); see the module doc.

    ``markers`` None (no policy tokenizer): 0, the whole output. ``reasoning_split``: the reply
    came back with reasoning apart from content (the server runs a reasoning parser)."""
    if not output_ids:
        return None
    if markers is None or not reasoning_split:
        return 0
    for token in reversed(prompt_ids or ()):
        if token == markers.end:
            return 0
        if token == markers.start or token == markers.turn:
            break
    for i, token in enumerate(output_ids):
        if token == markers.end:
            return i + 1 if i + 1 < len(output_ids) else None
    return None


def upstream_chat(chat: dict[str, Any], mode: str, notes: list[str]) -> dict[str, Any]:
    """The chat body to send upstream under ``polar_harness_constraints=mode``; a note on
    ``notes`` when something was left out."""
    if mode != DROP:
        return chat
    body, note = without_harness_constraints(chat)
    if note:
        notes.append(note)
    return body


def note_constraints(
    record: Any,
    body: dict[str, Any] | None,
    markers: ThinkMarkers | None,
    reasoning_split: bool,
    tool_calls: int,
) -> None:
    """Put on the record why its output was sampled under a grammar and from which token
    (``constrained_by``, ``constrained_from``); ``body`` is the chat request sent upstream
    (None: the call went token-in, which carries no tools). Cheap: once per call."""
    if body is None:
        return
    if tool_calls > 1 and any(PARALLEL_FALSE in n for n in record.translation_notes):
        record.translation_notes.append(
            f"{tool_calls} tool calls in one reply, passed on to the harness, which asked "
            "parallel_tool_calls=false (polar_harness_constraints=drop)"
        )
    reasons = constraint_reasons(body)
    if not reasons:
        return
    record.constrained_by = reasons
    if record.status == "completed":
        record.constrained_from = constrained_from(
            record.prompt_token_ids, record.output_token_ids, markers, reasoning_split
        )
