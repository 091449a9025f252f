"""The OpenAI Responses reply, written as the chat-completions chunks arrive (`ResponsesStream`,
a `BlockStream`), or whole from a finished reply: the `response.*` events Codex reads, reasoning
items (sealed into `encrypted_content` when asked), custom tool calls streamed as their `input`,
and a compaction's summary (`_CompactionStream`). The request side is `openai_responses.py`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from ..core.sse import encode_json
from .assemble import ToolCallParts
from .base import HarnessRequest
from .blocks import BlockStream
from .convert import new_id, safe_id, seal
from .usage import counts, responses_usage

_CONTEXT_TOO_LONG = re.compile(r"maximum context length|context length|too many tokens", re.I)


@dataclass(frozen=True, slots=True)
class ToolRef:
    """How a tool the policy sees maps back to the harness's tool."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


def error_code(status: int, message: str, kind: str) -> str | None:
    """OpenAI's error codes that Codex acts on (it compacts on context_length_exceeded)."""
    if _CONTEXT_TOO_LONG.search(message) and (status == 400 or kind == "invalid_request_error"):
        return "context_length_exceeded"
    if status == 429 or kind == "rate_limit_error":
        return "rate_limit_exceeded"
    return None


class _InputDecoder:
    """The `input` string of a custom tool call's JSON arguments, decoded while it streams.

    The arguments arrive as JSON text in arbitrary pieces (`{"input": "con` ...); the decoded
    characters of the string are handed out as soon as they are complete, so the harness sees
    `custom_tool_call_input.delta` live. Arguments of any other shape are left to the end.
    """

    _PREFIX = '{"input":"'
    __slots__ = ("buf", "pos", "state")

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self.state = "prefix"  # prefix | string | done | off

    def feed(self, delta: str) -> str:
        self.buf += delta
        if self.state == "prefix":
            compact = "".join(self.buf.split())
            if compact.startswith(self._PREFIX):
                match = re.match(r'\s*\{\s*"input"\s*:\s*"', self.buf)
                if match is None:
                    self.state = "off"
                    return ""
                self.pos, self.state = match.end(), "string"
            elif not self._PREFIX.startswith(compact):
                self.state = "off"
        if self.state != "string":
            return ""
        return self._decode()

    def _decode(self) -> str:
        buf, pos, out = self.buf, self.pos, []
        n = len(buf)
        while pos < n:
            c = buf[pos]
            if c == '"':
                self.state = "done"
                pos += 1
                break
            if c != "\\":
                end = pos + 1
                while end < n and buf[end] not in '"\\':
                    end += 1
                out.append(buf[pos:end])
                pos = end
                continue
            if pos + 1 >= n:
                break
            esc = buf[pos + 1]
            if esc != "u":
                out.append(_ESCAPES.get(esc, esc))
                pos += 2
                continue
            if pos + 6 > n:
                break
            code = int(buf[pos + 2 : pos + 6], 16) if _is_hex(buf[pos + 2 : pos + 6]) else 0xFFFD
            if 0xD800 <= code < 0xDC00:  # a surrogate pair: wait for its second half
                if pos + 12 > n:
                    break
                low = buf[pos + 8 : pos + 12]
                if buf[pos + 6 : pos + 8] == "\\u" and _is_hex(low):
                    code = 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)
                    pos += 6
            out.append(chr(code) if not 0xD800 <= code < 0xE000 else "\ufffd")
            pos += 6
        self.pos = pos
        return "".join(out)


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _is_hex(s: str) -> bool:
    return len(s) == 4 and all(c in "0123456789abcdefABCDEF" for c in s)


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the policy wrote for its one-string function."""
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, ValueError):
        return arguments  # the policy wrote the input itself
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    if isinstance(value, str):
        return value
    return arguments


def _logprobs(lp: Any) -> list[dict[str, Any]]:
    out = []
    for entry in (lp or {}).get("content") or ():
        out.append(
            {
                "token": entry.get("token", ""),
                "logprob": entry.get("logprob", 0.0),
                "bytes": entry.get("bytes"),
                "top_logprobs": [
                    {
                        "token": t.get("token", ""),
                        "logprob": t.get("logprob", 0.0),
                        "bytes": t.get("bytes"),
                    }
                    for t in entry.get("top_logprobs") or ()
                ],
            }
        )
    return out


class ResponsesStream(BlockStream):
    """Chat chunks -> Responses events (and, at the end, the whole `response` object)."""

    def __init__(self, req: HarnessRequest, live: bool = True) -> None:
        super().__init__()
        self.req = req
        self.live = live
        self.refs: dict[str, ToolRef] = req.extra.get("tools") or {}
        self.sealing = bool(req.extra.get("seal"))
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.item: dict[str, Any] = {}
        self.pieces: list[str] = []
        self.lps: list[dict[str, Any]] = []
        self.decoder: _InputDecoder | None = None
        self.opened_name = ""
        self.response = _base_response(req)

    # -- events --------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> None:
        if not self.live:
            return
        fields["type"] = kind
        fields["sequence_number"] = self.seq
        self.seq += 1
        self.emit(encode_json(fields, kind))

    def on_item(self, kind: str, **fields: Any) -> None:
        """An event about the open item."""
        self.event(kind, item_id=self.item["id"], output_index=self.index, **fields)

    def _lifecycle(self, kind: str, status: str) -> None:
        self.response["status"] = status
        self.event(kind, response=self.response)

    @property
    def index(self) -> int:
        return len(self.output)

    def _open(self, item: dict[str, Any]) -> None:
        self.item = item
        self.pieces = []
        self.event("response.output_item.added", output_index=self.index, item=dict(item))

    def _done(self, item: dict[str, Any]) -> None:
        item["status"] = "completed"
        self.event("response.output_item.done", output_index=self.index, item=item)
        self.output.append(item)

    # -- hooks ---------------------------------------------------------------------------------

    def on_start(self, first_chunk: dict[str, Any]) -> None:
        self._lifecycle("response.created", "in_progress")
        self._lifecycle("response.in_progress", "in_progress")

    def on_open_reasoning(self) -> None:
        self._open(
            {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        )
        self.on_item(
            "response.content_part.added",
            content_index=0,
            part={"type": "reasoning_text", "text": ""},
        )

    def on_reasoning(self, text: str) -> None:
        self.pieces.append(text)
        self.on_item("response.reasoning_text.delta", content_index=0, delta=text)

    def on_close_reasoning(self) -> None:
        item, text = self.item, "".join(self.pieces)
        part = {"type": "reasoning_text", "text": text}
        self.on_item("response.reasoning_text.done", content_index=0, text=text)
        self.on_item("response.content_part.done", content_index=0, part=part)
        item["content"] = [part]
        if self.sealing:
            item["encrypted_content"] = seal(text)
        self._done(item)

    def on_open_text(self) -> None:
        self._open(
            {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "content": [],
                "status": "in_progress",
            }
        )
        self.lps = []
        self.on_item(
            "response.content_part.added",
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )

    def on_text(self, text: str, logprobs: Any) -> None:
        self.pieces.append(text)
        lps = _logprobs(logprobs) if self.req.wants_logprobs else []
        self.lps.extend(lps)
        self.on_item("response.output_text.delta", content_index=0, delta=text, logprobs=lps)

    def on_close_text(self) -> None:
        item, text = self.item, "".join(self.pieces)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.lps}
        self.on_item("response.output_text.done", content_index=0, text=text, logprobs=self.lps)
        self.on_item("response.content_part.done", content_index=0, part=part)
        item["content"] = [part]
        self._done(item)

    def _ref(self, name: str) -> ToolRef:
        return self.refs.get(name) or ToolRef("function", name)  # a tool the harness never offered

    def on_open_tool(self, tool: ToolCallParts) -> None:
        self.opened_name = tool.name
        ref = self._ref(tool.name)
        tool.id = safe_id(tool.id, "call_")
        item: dict[str, Any] = {
            "id": new_id("ctc_" if ref.kind == "custom" else "fc_"),
            "type": "custom_tool_call" if ref.kind == "custom" else "function_call",
            "status": "in_progress",
            "call_id": tool.id,
            "name": ref.name,
        }
        if ref.namespace:
            item["namespace"] = ref.namespace
        if ref.kind == "custom":
            item["input"] = ""
            self.decoder = _InputDecoder()
        else:
            item["arguments"] = ""
            self.decoder = None
        self._open(item)

    def on_tool_arguments(self, tool: ToolCallParts, delta: str) -> None:
        if self.decoder is None:
            self.on_item("response.function_call_arguments.delta", delta=delta)
            return
        text = self.decoder.feed(delta)
        if text:
            self.on_item("response.custom_tool_call_input.delta", delta=text)

    def on_close_tool(self, tool: ToolCallParts) -> None:
        item = self.item
        if tool.name != self.opened_name:  # the name was still streaming when the item opened
            ref = self._ref(tool.name)
            item["name"] = ref.name
            item.pop("namespace", None)
            if ref.namespace:
                item["namespace"] = ref.namespace
        if item["type"] == "custom_tool_call":
            item["input"] = custom_input(tool.arguments)
            self.on_item("response.custom_tool_call_input.done", input=item["input"])
        else:
            item["arguments"] = tool.arguments
            self.on_item(
                "response.function_call_arguments.done", name=item["name"], arguments=tool.arguments
            )
        self._done(item)

    def on_end(self) -> None:
        response = self.response
        response["output"] = self.output
        response["usage"] = responses_usage(counts(self.usage, self.prompt_tokens))
        if self.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            self._lifecycle("response.incomplete", "incomplete")
        else:
            response["completed_at"] = int(time.time())
            self._lifecycle("response.completed", "completed")

    def on_fail(self, message: str, kind: str) -> None:
        response = self.response
        response["output"] = self.output
        code = error_code(0, message, kind) or "server_error"
        response["error"] = {"code": code, "message": message}
        self._lifecycle("response.failed", "failed")

    def final(self) -> dict[str, Any]:
        return self.response


def _base_response(req: HarnessRequest) -> dict[str, Any]:
    """The `response` object of the lifecycle events, with the harness's own settings echoed."""
    data = req.body
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "model": req.model or "",
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": (data.get("reasoning") or {}).get("effort"), "summary": None},
        "store": data.get("store", True),
        "temperature": data.get("temperature", 1.0),
        "text": data.get("text") or {"format": {"type": "text"}},
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p", 1.0),
        "truncation": data.get("truncation") or "disabled",
        "usage": None,
        "user": None,
        "metadata": data.get("metadata") or {},
    }


class _CompactionStream(ResponsesStream):
    """The reply to a compaction request: exactly one `compaction` item holding the summary.

    The policy's text is the summary; it is not streamed as text (the harness expects only the
    item) but sealed into the item's `encrypted_content` when the reply ends. Its thinking and
    any tool call it makes anyway are policy tokens in the call's record, but no part of the
    summary: the harness could not run a tool from a compaction reply. `/responses/compact` gets
    the same item in a `response.compaction` object, after the user messages it keeps."""

    def __init__(self, req: HarnessRequest, live: bool = True) -> None:
        super().__init__(req, live)
        self.summary: list[str] = []
        self.opened = False

    def _open_compaction(self) -> None:
        if not self.opened:
            self.opened = True
            self._open({"id": new_id("cmp_"), "type": "compaction"})
            self.on_item("response.compaction.compacting")

    def on_open_reasoning(self) -> None:
        pass

    def on_reasoning(self, text: str) -> None:
        pass

    def on_close_reasoning(self) -> None:
        pass

    def on_open_text(self) -> None:
        self._open_compaction()

    def on_text(self, text: str, logprobs: Any) -> None:
        self.summary.append(text)

    def on_close_text(self) -> None:
        pass

    def on_open_tool(self, tool: ToolCallParts) -> None:
        pass

    def on_tool_arguments(self, tool: ToolCallParts, delta: str) -> None:
        pass

    def on_close_tool(self, tool: ToolCallParts) -> None:
        pass

    def on_end(self) -> None:
        self._open_compaction()
        item = self.item
        item["encrypted_content"] = seal("".join(self.summary).strip())
        self._done(item)
        super().on_end()

    def final(self) -> dict[str, Any]:
        if self.req.extra.get("compaction") != "endpoint":
            return self.response
        kept = [
            _output_message(item)
            for item in self.req.body.get("input") or ()
            if isinstance(item, dict)
            and item.get("type", "message") == "message"
            and item.get("role") == "user"
        ]
        return {
            "id": self.response["id"],
            "object": "response.compaction",
            "created_at": self.response["created_at"],
            "output": [*kept, *self.output],
            "usage": self.response["usage"],
        }


def _output_message(item: dict[str, Any]) -> dict[str, Any]:
    """A user message of the input as an output item (what `/responses/compact` returns)."""
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    return {
        "id": item.get("id") or new_id("msg_"),
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": content,
    }


def translator(req: HarnessRequest, live: bool = True) -> ResponsesStream:
    if req.extra.get("compaction"):
        return _CompactionStream(req, live)
    return ResponsesStream(req, live)
