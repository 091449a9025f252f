"""Qwen3's output format: vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser, reproduced.

These mirror what ``vllm serve Qwen/Qwen3-… --reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser hermes`` does to the detokenized output (read from
``vllm/reasoning/qwen3_reasoning_parser.py``, ``vllm/tool_parsers/hermes_tool_parser.py`` and
``vllm/parser/abstract_parser.py``; the code is ours, the behaviour theirs):

Non-streaming: ``<think>`` is stripped, the text before ``</think>`` is the reasoning and the rest the
content; without ``</think>`` everything is reasoning when thinking is on (a truncated think block) and
content when it is off. The hermes parser then takes each ``<tool_call>{json}</tool_call>`` region out
of the content (arguments re-serialized with ``json.dumps(..., ensure_ascii=False)``); the text before
the first region is the content, ``None`` when it is only whitespace. A region that is not valid JSON
leaves the whole content as text.

Streaming (:class:`StreamParser`): deltas before ``</think>`` go to the reasoning field; in the chunk
that carries ``</think>`` the rest of the chunk is re-fed to the tool parser. vLLM's hermes streaming
parser re-parses the accumulated content each time and sends only what is new (``hermes_stream.py``
sends the same but reads each character once): plain content up to (not
including) a possible ``<tool_call>`` prefix; for each tool call first ``{index, id, type, function:
{name}}`` once the name is complete, then ``{index, function: {arguments}}`` fragments of the raw
arguments text (brace-matched, so the outer ``}`` of the call object is never sent).

Deltas are plain dicts whose keys are a subset of ``content``/``reasoning``/``tool_calls``; a key is
present exactly when vLLM's ``DeltaMessage`` would have the field *set* (``model_dump_json(
exclude_unset=True)``), so ``{"content": None, "tool_calls": [...]}`` really carries a ``null``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import Family
from .hermes_stream import TOOL_START, HermesStream, make_tool_call_id

THINK_START = "<think>"
THINK_END = "</think>"

_TOOL_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

Delta = dict[str, Any]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI wire carries it


def message_tool_calls(calls: Sequence[ParsedToolCall]) -> list[dict[str, Any]]:
    """Parsed tool calls as a chat message's ``tool_calls`` (each with a fresh vLLM-style id)."""
    return [
        {
            "id": make_tool_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]


def split_reasoning(text: str, thinking_enabled: bool = True) -> tuple[str | None, str | None]:
    """Qwen3ReasoningParser.extract_reasoning: (reasoning, content)."""
    before, marker, after = text.partition(THINK_START)
    text = after if marker else before
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    if not thinking_enabled:
        return None, text
    return text, None


def extract_tool_calls(content: str) -> tuple[str | None, tuple[ParsedToolCall, ...]]:
    """Hermes2ProToolParser.extract_tool_calls: (content before the calls, calls)."""
    if TOOL_START not in content:
        return content, ()
    try:
        calls = []
        for closed, unclosed in _TOOL_REGION.findall(content):
            raw = json.loads(closed if closed else unclosed)
            calls.append(
                ParsedToolCall(
                    name=raw["name"], arguments=json.dumps(raw["arguments"], ensure_ascii=False)
                )
            )
    except Exception:  # vLLM logs and falls back to plain content
        return content, ()
    before = content[: content.find(TOOL_START)]
    return (before if before.strip() else None), tuple(calls)


def parse_output(
    text: str, *, thinking_enabled: bool, parse_tools: bool, reasoning: bool = True
) -> ParsedOutput:
    """The non-streaming split of a whole output text."""
    if reasoning:
        reasoning_text, content = split_reasoning(text, thinking_enabled)
    else:
        reasoning_text, content = None, text
    calls: tuple[ParsedToolCall, ...] = ()
    if parse_tools and content is not None:
        content, calls = extract_tool_calls(content)
    return ParsedOutput(reasoning=reasoning_text, content=content, tool_calls=calls)


class StreamParser:
    """Turns one stream's chunks (text + token ids) into vLLM's deltas, one call per chunk."""

    def __init__(
        self,
        *,
        think_start_id: int | None,
        think_end_id: int | None,
        parse_tools: bool,
        reasoning: bool = True,
        reasoning_open: bool | None = None,
    ):
        """``reasoning_open`` is :meth:`Renderer.reasoning_open_at_end` of the prompt: ``False`` means
        the prompt already closed the think block, so every delta is content (or tool calls)."""
        self._start_id = think_start_id
        self._end_id = think_end_id
        self._reasoning = reasoning and think_end_id is not None
        self._reasoning_ended = not self._reasoning or reasoning_open is False
        self._tools = HermesStream() if parse_tools else None
        self._tool_text_started = False
        self._text = ""
        self.tools_streamed = False

    def _reasoning_delta(self, delta_text: str, delta_ids: Sequence[int]) -> Delta | None:
        if self._start_id is not None and self._start_id in delta_ids:
            start = delta_text.find(THINK_START)
            if start >= 0:
                delta_text = delta_text[start + len(THINK_START) :]
        if self._end_id in delta_ids:
            end = delta_text.find(THINK_END)
            if end < 0:
                return None
            reasoning, content = delta_text[:end], delta_text[end + len(THINK_END) :]
            if not reasoning and not content:
                return None
            return {"content": content or None, "reasoning": reasoning or None}
        if not delta_text:
            return None
        return {"reasoning": delta_text}

    def feed(self, delta_text: str, delta_ids: Sequence[int]) -> Delta | None:
        """The delta for one chunk, or ``None`` where vLLM's parser returns nothing."""
        current = self._text + delta_text
        delta: Delta | None = None
        transitioned = False
        if not self._reasoning_ended:
            delta = self._reasoning_delta(delta_text, delta_ids)
            if self._end_id in delta_ids:
                self._reasoning_ended = transitioned = True
                current = (delta or {}).get("content") or ""
                delta_text = current
        if self._reasoning_ended and self._tools is not None:
            if not self._tool_text_started:
                self._tool_text_started = True
                delta_text = current
            reasoning = delta.get("reasoning") if delta else None
            delta = self._tools.feed(current)
            if reasoning:
                if delta is None:
                    delta = {"reasoning": reasoning}
                elif not delta.get("reasoning"):
                    delta["reasoning"] = reasoning
            if delta and delta.get("tool_calls"):
                self.tools_streamed = True
        elif self._reasoning_ended and delta is None and not transitioned:
            delta = {"content": delta_text}
        self._text = current
        return delta


def _family(name: str, reasoning: bool):
    return Family(
        name=name,
        think_start=THINK_START if reasoning else None,
        think_end=THINK_END if reasoning else None,
        turn_start="<|im_start|>",
        stream_factory=StreamParser,
        parse_factory=parse_output,
    )


#: ``qwen3``: ``<think>`` reasoning + hermes ``<tool_call>`` JSON (Qwen3, Qwen3.5/3.6 dense and MoE);
#: ``hermes``: the tool calls only (Qwen2.5, Hermes-style models without a reasoning block).
FAMILIES = (_family("qwen3", True), _family("hermes", False))
