"""Chat-completions chunks as a sequence of output blocks: the shared half of block dialects.

The Responses API (output items) and Anthropic Messages (content blocks) both stream a reply as
blocks that are opened, filled and closed one at a time: reasoning, text, one per tool call.
`BlockStream` reads the policy server's chunks once — reasoning / content / tool-call deltas,
finish reason, usage — decides where a block starts and ends, and calls the dialect's hooks;
a dialect only says what each hook writes. Everything is decided from the chunks alone, so the
same code serves a live upstream stream and a stream synthesized from a whole reply
(`assemble.reply_to_chunks`), and the non-streaming reply is the same translator fed that way.

Per chunk the work is a few dict lookups and the dialect's own event encoding; nothing is held
back but whitespace at the end of the text so far. vLLM's tool-call parser hands back the
separator before a `<tool_call>` as content ("...now.\n"); sent back next turn it would be
rendered twice (the template writes its own), and the prompt would no longer extend the tokens
the policy sampled. So trailing whitespace waits: it is sent with the next text, or as the
block's last text when the reply ends, and dropped when a tool call follows — which also means a
text block of whitespace alone never appears (harnesses show no empty message).
"""

from __future__ import annotations

from typing import Any

from .assemble import REASONING_KEYS, ToolCallParts
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
        self._held = ""  # trailing whitespace of the text so far, not sent yet
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
        self._close(flush=True)
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
            self._close(flush=True)
            self.block = "reasoning"
            self.on_open_reasoning()
        self.on_reasoning(text)

    def _text(self, text: str, logprobs: Any) -> None:
        body = text.rstrip()
        if not body:  # whitespace: held until real text follows (see the module docstring)
            if self.block not in (None, "text"):
                self._close(flush=True)
            self._held += text
            return
        if self._held:
            body, self._held = self._held + body, ""
        if self.block != "text":
            self._close(flush=True)
            self.block = "text"
            self.on_open_text()
        self.on_text(body, logprobs)
        self._held = text[len(text.rstrip()) :]

    def _tool(self, call: dict[str, Any]) -> None:
        index = call.get("index", len(self.tools))
        function = call.get("function") or {}
        parts = self.tools.get(index)
        if parts is None:
            parts = self.tools[index] = ToolCallParts(index)
            parts.id = call.get("id")
            parts.name = function.get("name") or ""
            self._close(flush=False)
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

    def _close(self, flush: bool) -> None:
        """End the open block. Whitespace held at the end of a text block is its last text
        (`flush`), except before a tool call: there it is the separator the chat template
        writes itself, and sent back as content it would be rendered twice."""
        held, self._held = self._held, ""
        block, self.block = self.block, None
        if block == "text" and held and flush:
            self.on_text(held, None)
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
