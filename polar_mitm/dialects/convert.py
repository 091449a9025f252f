"""Request-side helpers shared by the dialects that translate to chat completions.

`ChatBuilder` turns a harness's history — items or content blocks, whatever the dialect calls
them — into chat messages with one rule set for everyone:

* one assistant message per model turn: the reasoning, text and tool calls the policy produced
  in one generation arrive as separate items (Responses) or blocks (Anthropic) and are merged
  back into the single assistant message the chat template renders (reasoning as vLLM's input
  field `reasoning`, so the template re-renders the thinking it generated);
* text parts of one message are joined with "\\n" (what vLLM does to a list of text parts) and
  sent as a string, so every server kind renders the same text (SGLang joins with a space);
* content with images stays a list of `text` / `image_url` parts.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from ..core.sse import dumps
from .base import DialectError

# Tool-call ids the harnesses accept as they are (Anthropic's pattern; OpenAI's ids fit it too).
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def safe_id(value: str | None, prefix: str) -> str:
    """The upstream's tool-call id when it is a plain token, else a fresh one."""
    if isinstance(value, str) and 0 < len(value) <= 128 and all(c in _ID_CHARS for c in value):
        return value
    return new_id(prefix)


SEAL = "polar1:"


def seal(reasoning: str) -> str:
    """The thinking as the opaque field a dialect round-trips (Responses `encrypted_content`,
    Anthropic `signature`): not encrypted, only base64, so it comes back next turn even from a
    harness that drops the plain text (Claude Code with `display: omitted`)."""
    return SEAL + base64.b64encode(reasoning.encode()).decode()


def unseal(value: Any) -> str | None:
    """The thinking `seal` packed, or None for a value we did not make (e.g. the real API's)."""
    if not isinstance(value, str) or not value.startswith(SEAL):
        return None
    try:
        return base64.b64decode(value[len(SEAL) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def content_of(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content for a list of text/image parts: a string unless there is an image."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def function_tool(
    name: str, description: str | None, parameters: Any, strict: Any = None
) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object"}
    if isinstance(strict, bool):
        function["strict"] = strict
    return {"type": "function", "function": function}


def arguments_json(value: Any) -> str:
    """Tool-call arguments as the JSON string chat completions carries (compact, unescaped)."""
    if isinstance(value, str):
        return value
    return dumps(value)


class ChatBuilder:
    """Chat messages from a history, merging each model turn into one assistant message."""

    __slots__ = ("messages", "_turn", "_texts", "_reasoning")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None
        self._texts: list[str] = []
        self._reasoning: list[str] = []

    # -- non-assistant messages end the model's turn ------------------------------------------

    def system(self, text: str) -> None:
        self._end_turn()
        self.messages.append({"role": "system", "content": text})

    def user(self, content: str | list[dict[str, Any]]) -> None:
        self._end_turn()
        self.messages.append({"role": "user", "content": content})

    def tool_result(self, call_id: str, content: str | list[dict[str, Any]]) -> None:
        self._end_turn()
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})

    # -- the model's turn ----------------------------------------------------------------------

    def assistant_text(self, text: str) -> None:
        self._open_turn()
        self._texts.append(text)

    def reasoning(self, text: str) -> None:
        self._open_turn()
        self._reasoning.append(text)

    def tool_call(self, call_id: str, name: str, arguments: str) -> None:
        turn = self._open_turn()
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    def end_turn(self) -> None:
        """Two assistant messages in a row in the harness's history stay two turns."""
        self._end_turn()

    def result(self) -> list[dict[str, Any]]:
        self._end_turn()
        return self.messages

    def _open_turn(self) -> dict[str, Any]:
        if self._turn is None:
            self._turn = {"role": "assistant", "content": ""}
            self.messages.append(self._turn)
        return self._turn

    def _end_turn(self) -> None:
        turn = self._turn
        if turn is None:
            return
        turn["content"] = "\n".join(self._texts)
        if self._reasoning:
            turn["reasoning"] = "\n".join(self._reasoning)
        self._turn = None
        self._texts = []
        self._reasoning = []


def number(data: dict[str, Any], key: str, low: float, high: float) -> float | int | None:
    """An optional sampling parameter, range-checked like the real APIs do."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise DialectError(f"'{key}' must be a number between {low:g} and {high:g}")
    return value


def positive_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DialectError(f"'{key}' must be a positive integer")
    return value
