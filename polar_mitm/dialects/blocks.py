"""Chat-completions chunks as a sequence of output blocks: the shared half of block dialects.

The Responses API (output items) and Anthropic Messages (content blocks) both stream a reply as
blocks that are opened, filled and closed one at a time: reasoning, text, one per tool call.
`BlockStream` reads the policy server's chunks once — reasoning / content / tool-call deltas,
finish reason, usage — decides where a block starts and ends, and calls the dialect's hooks;
a dialect only says what each hook writes. Everything is decided from the chunks alone, so the
same code serves a live upstream stream and a stream synthesized from a whole reply
(`assemble.reply_to_chunks`), and the non-streaming reply is the same translator fed that way.

Per chunk the work is a few dict lookups and the dialect's own event encoding; nothing is held
back except a text block that is only whitespace so far (the separator a tool-call parser leaves
before a call): it is sent as soon as real text follows, and dropped if a tool call or the end
comes first, so harnesses never show an empty message.
"""

from __future__ import annotations

from typing import Any

from ..assemble import REASONING_KEYS, ToolCallParts
from .base import StreamTranslator


class BlockStream(StreamTranslator):
    """Template for a block dialect's stream; subclasses implement the `on_*` hooks and `final`."""

    def __init__(self) -> None:
        self.out: list[bytes] = []  # encoded events of the current chunk
        self.started = False
        self.block: str | None = None  # "reasoning" | "text" | "tool" | None
        self.tool: ToolCallParts | None = None  # the open tool call
        self.tools: dict[int, ToolCallParts] = {}
        self.calls: list[ToolCallParts] = []  # in the order they were opened
        self._pending_ws: list[str] = []  # whitespace-only text not sent yet
        self._pending_lp: list[dict[str, Any]] = []  # its logprob entries
        self.finish_reason: str | None = None
        self.stop_match: Any = None  # vLLM's `stop_reason`: the stop string or token that ended it
        self.usage: dict[str, Any] | None = None
        self.ended = False

    # -- the StreamTranslator side -------------------------------------------------------------

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if not self.started:
            self.started = True
            self.on_start(chunk)
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        choices = chunk.get("choices")
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or choice.get("message") or {}
            for key in REASONING_KEYS:
                reasoning = delta.get(key)
                if reasoning:
                    self._reasoning(reasoning)
                    break
            text = delta.get("content")
            if text:
                self._text(text, choice.get("logprobs"))
            calls = delta.get("tool_calls")
            if calls:
                for call in calls:
                    self._tool(call)
            finish = choice.get("finish_reason")
            if finish:
                self.finish_reason = finish
                self.stop_match = choice.get("stop_reason")
        return self._flush()

    def finish(self) -> bytes:
        if not self.started:
            self.started = True
            self.on_start({})
        self._close()
        self.ended = True
        self.on_end()
        return self._flush()

    def fail(self, message: str, kind: str = "server_error") -> bytes:
        if not self.started:
            self.started = True
            self.on_start({})
        self.ended = True
        self.on_fail(message, kind)
        return self._flush()

    def run(self, chunks: list[dict[str, Any]]) -> dict[str, Any]:
        """Feed a whole reply's chunks and return the dialect's non-streaming reply object."""
        for chunk in chunks:
            self.chunk(chunk)
        self.finish()
        return self.final()

    # -- block switching ----------------------------------------------------------------------

    def _reasoning(self, text: str) -> None:
        if self.block != "reasoning":
            self._close()
            self.block = "reasoning"
            self.on_open_reasoning()
        self.on_reasoning(text)

    def _text(self, text: str, logprobs: Any) -> None:
        if self.block == "text":
            self.on_text(text, logprobs)
            return
        if not text.strip():  # a text block starts only once it has more than whitespace
            if self.block is not None:
                self._close()
            self._pending_ws.append(text)
            if logprobs and logprobs.get("content"):
                self._pending_lp.extend(logprobs["content"])
            return
        if self._pending_ws:
            text = "".join(self._pending_ws) + text
            if self._pending_lp:
                logprobs = {
                    "content": self._pending_lp + list((logprobs or {}).get("content") or ())
                }
        self._close()
        self.block = "text"
        self.on_open_text()
        self.on_text(text, logprobs)

    def _tool(self, call: dict[str, Any]) -> None:
        index = call.get("index", len(self.tools))
        function = call.get("function") or {}
        parts = self.tools.get(index)
        if parts is None:
            parts = self.tools[index] = ToolCallParts(index)
            parts.id = call.get("id")
            parts.name = function.get("name") or ""
            self._close()
            self.block = "tool"
            self.tool = parts
            self.calls.append(parts)
            self.on_open_tool(parts)
        elif function.get("name") and parts is self.tool and not parts.arguments:
            parts.name += function["name"]  # a server that streams the name in pieces
        args = function.get("arguments")
        if args:
            parts.arguments += args
            if parts is self.tool:
                self.on_tool_arguments(parts, args)
            # else: a delta for a call already closed (no server interleaves calls); the final
            # objects still carry the whole arguments

    def _close(self) -> None:
        if self._pending_ws:
            self._pending_ws = []
            self._pending_lp = []
        block, self.block = self.block, None
        if block == "reasoning":
            self.on_close_reasoning()
        elif block == "text":
            self.on_close_text()
        elif block == "tool":
            tool, self.tool = self.tool, None
            assert tool is not None
            self.on_close_tool(tool)

    def emit(self, data: bytes) -> None:
        self.out.append(data)

    def _flush(self) -> bytes:
        if not self.out:
            return b""
        data = b"".join(self.out)
        self.out.clear()
        return data

    # -- hooks ---------------------------------------------------------------------------------

    def on_start(self, first_chunk: dict[str, Any]) -> None: ...

    def on_open_reasoning(self) -> None: ...

    def on_reasoning(self, text: str) -> None: ...

    def on_close_reasoning(self) -> None: ...

    def on_open_text(self) -> None: ...

    def on_text(self, text: str, logprobs: Any) -> None: ...

    def on_close_text(self) -> None: ...

    def on_open_tool(self, tool: ToolCallParts) -> None: ...

    def on_tool_arguments(self, tool: ToolCallParts, delta: str) -> None: ...

    def on_close_tool(self, tool: ToolCallParts) -> None: ...

    def on_end(self) -> None: ...

    def on_fail(self, message: str, kind: str) -> None: ...

    def final(self) -> dict[str, Any]:
        raise NotImplementedError
