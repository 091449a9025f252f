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
that carries ``</think>`` the rest of the chunk is re-fed to the tool parser. The hermes streaming parser
re-parses the accumulated content each time and sends only what is new: plain content up to (not
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
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Family

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

_TOOL_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_TOOL_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_TOOL_ARGS = re.compile(r'"arguments"\s*:\s*')

Delta = dict[str, Any]


def make_tool_call_id() -> str:
    """vLLM's default tool-call id (``chatcmpl-tool-`` + a random uuid4 hex)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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


def _partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_CLOSING = {"{": "}", "[": "]"}


def _is_complete_json(text: str) -> bool:
    """Whether `json.loads` takes `text` (a tool call's body so far). Asked on every streamed
    token of a tool call, where the answer is no until its last: a text that opens an object or
    array and ends with a character that is neither its closing bracket nor whitespace is not
    JSON (a document's last character is one of those), and is answered without `json.loads`
    raising and building its error."""
    close = _CLOSING.get(text[:1])
    if close is not None and text[-1:] != close and not text[-1:].isspace():
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _tool_args(tc_json: str, is_complete: bool) -> str | None:
    """The raw ``arguments`` value inside a (possibly partial) tool-call JSON, brace-matched."""
    match = _TOOL_ARGS.search(tc_json)
    if not match:
        return None
    raw = tc_json[match.end() :]
    if not raw or raw[0] not in "{[":
        if is_complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw
    open_ch, close_ch = raw[0], "}" if raw[0] == "{" else "]"
    depth, in_str, esc = 0, False, False
    for i, c in enumerate(raw):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return raw[: i + 1]
    return raw


@dataclass
class _HermesStream:
    sent_content: int = 0
    names: list[str | None] = field(default_factory=list)
    sent_args: list[str] = field(default_factory=list)

    def _content(self, text: str) -> str | None:
        if TOOL_START in text:
            sendable = text.index(TOOL_START)
        else:
            sendable = len(text) - _partial_tag_overlap(text, TOOL_START)
        if sendable > self.sent_content:
            out = text[self.sent_content : sendable]
            self.sent_content = sendable
            return out
        return None

    @staticmethod
    def _regions(text: str) -> list[tuple[str, bool]]:
        regions, pos = [], 0
        while True:
            start = text.find(TOOL_START, pos)
            if start == -1:
                return regions
            body_start = start + len(TOOL_START)
            end = text.find(TOOL_END, body_start)
            if end != -1:
                regions.append((text[body_start:end].strip(), True))
                pos = end + len(TOOL_END)
                continue
            raw = text[body_start:]
            overlap = _partial_tag_overlap(raw, TOOL_END)
            if overlap:
                raw = raw[:-overlap]
            body = raw.strip()
            regions.append((body, _is_complete_json(body) if body else False))
            return regions

    def feed(self, current_text: str) -> Delta | None:
        content = self._content(current_text)
        calls: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(self._regions(current_text)):
            if i >= len(self.names):
                self.names.append(None)
                self.sent_args.append("")
            if self.names[i] is None:
                match = _TOOL_NAME.search(body)
                if not match:
                    break  # tool i+1 cannot start before tool i has its name
                self.names[i] = match.group(1)
                calls.append(
                    {
                        "id": make_tool_call_id(),
                        "type": "function",
                        "index": i,
                        "function": {"name": match.group(1)},
                    }
                )
            args = _tool_args(body, complete)
            if args is not None and len(args) > len(self.sent_args[i]):
                calls.append(
                    {"index": i, "function": {"arguments": args[len(self.sent_args[i]) :]}}
                )
                self.sent_args[i] = args
        if content or calls:
            delta: Delta = {"content": content}
            if calls:
                delta["tool_calls"] = calls
            return delta
        return None


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
        self._tools = _HermesStream() if parse_tools else None
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
