"""What an output parser is: a model family's `Family` and its `StreamingParser`.

Apart from the package's `__init__`, which registers the families: the family modules import
this, the registry imports them, and no import runs back up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class StreamingParser(Protocol):
    """One reply's incremental parser: raw text deltas (with their token ids) in, chat deltas out."""

    tools_streamed: bool

    def feed(self, delta_text: str, delta_ids: Sequence[int]) -> dict[str, Any] | None:
        """The chat delta (keys among ``content``, ``reasoning``, ``tool_calls``) or None."""
        ...


@dataclass(frozen=True)
class Family:
    """A model family's output format, bound to nothing: the tokenizer's specials come per call."""

    name: str
    think_start: str | None  # the token that opens a reasoning block, e.g. ``<think>``
    think_end: str | None
    turn_start: str | None  # the token that opens a chat turn, e.g. ``<|im_start|>``
    stream_factory: Any  # (think_start_id, think_end_id, parse_tools, reasoning_open) -> parser
    # (text, thinking_enabled, parse_tools, reasoning) -> object with .reasoning, .content and
    # .tool_calls (each with .name and .arguments): the server's non-streaming split
    parse_factory: Any

    def ids(self, specials: Mapping[str, int]) -> tuple[int | None, int | None, int | None]:
        """This family's marker ids in a tokenizer's vocabulary (None where it lacks one)."""
        return (
            specials.get(self.think_start) if self.think_start else None,
            specials.get(self.think_end) if self.think_end else None,
            specials.get(self.turn_start) if self.turn_start else None,
        )

    def stream(
        self, specials: Mapping[str, int], *, parse_tools: bool, reasoning_open: bool | None
    ) -> StreamingParser:
        start, end, _ = self.ids(specials)
        return self.stream_factory(
            think_start_id=start,
            think_end_id=end,
            parse_tools=parse_tools,
            reasoning_open=reasoning_open,
        )

    def parse(
        self, text: str, *, parse_tools: bool, reasoning_open: bool | None, thinking_enabled: bool
    ) -> Any:
        """A whole reply's split, as the server's non-streaming parsers make it."""
        return self.parse_factory(
            text,
            thinking_enabled=thinking_enabled,
            parse_tools=parse_tools,
            reasoning=reasoning_open is not False and self.think_end is not None,
        )

    def reasoning_open_at_end(
        self, specials: Mapping[str, int], prompt: Sequence[int]
    ) -> bool | None:
        """Whether the prompt's generation prompt left a reasoning block open (True), closed it
        (False: e.g. Qwen3 with ``enable_thinking: false``) or never opened one (None). Only the
        last turn counts: an earlier turn's end-of-thinking is not this turn's."""
        start, end, turn = self.ids(specials)
        for token in reversed(prompt):
            if token == end:
                return False
            if token == start:
                return True
            if token == turn:
                return None
        return None
