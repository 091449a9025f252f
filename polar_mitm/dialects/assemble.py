"""Chat-completions stream chunks <-> one assembled message, shared by every dialect.

`ChatAssembler` folds a stream of chunks into the message the harness ended up with (stored as
the record's response and used by dialects that must emit whole items at the end);
`reply_to_chunks` goes the other way for servers that cannot stream with token flags (SGLang):
the harness still gets a stream, synthesized from the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONING_KEYS = ("reasoning", "reasoning_content")  # vLLM's current name, and the older one


@dataclass(slots=True)
class ToolCallParts:
    index: int
    id: str | None = None
    type: str = "function"
    name: str = ""
    arguments: str = ""

    def as_message_part(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ChatAssembler:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallParts] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    id: str | None = None
    model: str | None = None
    created: int | None = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if self.id is None:
            self.id, self.model, self.created = (
                chunk.get("id"),
                chunk.get("model"),
                chunk.get("created"),
            )
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            return
        choice = choices[0]
        delta = choice.get("delta") or choice.get("message") or {}
        self.add_delta(delta)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def add_delta(self, delta: dict[str, Any]) -> None:
        # Type checks here, not when the message is built: a malformed chunk must fail while it is
        # being read (the exchange turns that into the dialect's error), never later.
        text = delta.get("content")
        if text:
            self.content.append(_text(text, "content"))
        for key in REASONING_KEYS:
            value = delta.get(key)
            if value:
                self.reasoning.append(_text(value, key))
                break
        for call in delta.get("tool_calls") or ():
            self.add_tool_delta(call)

    def add_tool_delta(self, call: dict[str, Any]) -> ToolCallParts:
        index = call.get("index", len(self.tool_calls))
        if type(index) is not int:
            raise TypeError(f"tool call index {index!r} is not an integer")
        parts = self.tool_calls.get(index)
        if parts is None:
            parts = self.tool_calls[index] = ToolCallParts(index)
        if call.get("id"):
            parts.id = call["id"]
        if call.get("type"):
            parts.type = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            parts.name += function["name"]
        if function.get("arguments"):
            parts.arguments += function["arguments"]
        return parts

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [
                self.tool_calls[i].as_message_part() for i in sorted(self.tool_calls)
            ]
        return message

    def as_reply(self) -> dict[str, Any]:
        """The assembled stream as a non-streaming chat.completion object."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": self.message(), "finish_reason": self.finish_reason}
            ],
            "usage": self.usage,
        }


def _text(value: Any, field: str) -> str:
    if type(value) is not str:
        raise TypeError(f"'{field}' is {type(value).__name__}, not a string")
    return value


def reasoning_of(message: dict[str, Any]) -> str | None:
    for key in REASONING_KEYS:
        value = message.get(key)
        if value:
            return value
    return None


def reply_to_chunks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat.completion as the chunks a streaming server would have sent."""
    base = {
        "id": reply.get("id"),
        "object": "chat.completion.chunk",
        "created": reply.get("created"),
        "model": reply.get("model"),
    }
    choices = reply.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict:
        return {
            **base,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    reasoning = reasoning_of(message)
    if reasoning:
        chunks.append(chunk({"reasoning": reasoning}))
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=choice.get("logprobs")))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        chunks.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call.get("id"),
                            "type": call.get("type", "function"),
                            "function": {
                                "name": function.get("name", ""),
                                "arguments": function.get("arguments", ""),
                            },
                        }
                    ]
                }
            )
        )
    final = chunk({}, choice.get("finish_reason") or "stop")
    if choice.get("stop_reason") is not None:  # vLLM: the stop string or token that ended it
        final["choices"][0]["stop_reason"] = choice["stop_reason"]
    chunks.append(final)
    if reply.get("usage"):
        chunks.append({**base, "choices": [], "usage": reply["usage"]})
    return chunks
