"""Anthropic Messages (`POST .../v1/messages`, `.../v1/messages/count_tokens`): Claude Code.

vLLM's own `/v1/messages` returns no token ids, so a Messages request becomes a chat-completions
request upstream and the chat stream becomes Anthropic events again, as they arrive.

Request (`parse`), shaped by what Claude Code 2.1 really sends (docs/dialects.md):
* `system` (a string or text blocks) is the first system message, minus Claude Code's
  `x-anthropic-billing-header:` block (it changes on every call, so rendered it would break every
  prompt's prefix); a `role: "system"` message inside `messages` (Claude Code sends one) stays a
  system message where it is; `cache_control` anywhere is dropped;
* an assistant message is one model turn: `thinking` blocks become the chat message's
  `reasoning` (so the template re-renders the thinking), `text` its content, `tool_use` its
  tool calls; `redacted_thinking` (Anthropic's ciphertext) cannot be rendered and is skipped;
* in a user message, `tool_result` blocks become tool messages, in place; text, images (base64
  or URL) and plain-text documents stay the user's content; other block types are refused with
  a 400 that names them;
* tools are function tools (`input_schema` is the parameters); a `defer_loading` tool is offered
  only once a `tool_reference` in a tool result has loaded it, as Anthropic does; server tools
  (web search, code execution, ...) cannot run behind this proxy and are refused;
* `thinking` (`enabled` / `adaptive` / `disabled`) and `output_config.effort` become
  `chat_template_kwargs` (`enable_thinking`, `reasoning_effort`).
What was left out is listed in `HarnessRequest.notes` (the record's `translation_notes`).

`count_tokens` is answered locally with the policy tokenizer (`local_reply`). Each request gets a
`purpose`: `count_tokens`; for a tool-less Claude Code call (its side calls on the small model
carry no tools; its main loop and sub-agents always do) `title`, `summary` or `side`; else `main`.

Reply: `message_start` (with the prompt's token count), `ping`, one content block per reasoning /
text / tool call (`thinking_delta`, `text_delta`, `input_json_delta`), `message_delta` with the
stop reason and usage, `message_stop`. A thinking block's `signature` is the thinking sealed
(`convert.seal`), so with `thinking.display: "omitted"` (Claude Code's setting) the text is not
streamed yet still comes back next turn. An upstream failure mid-stream ends the stream with an
`error` event, which the SDKs raise.

Just over 500 lines because a dialect is one module (so a new harness API is one new file): the
request translation, Claude Code's purposes (side calls, sub-agents, its compaction: markers in
`compaction`) and the event stream belong together; what every dialect shares is in `base`,
`blocks`, `convert`, `assemble`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..core.sse import encode_json
from . import compaction
from .assemble import ToolCallParts, reply_to_chunks
from .base import (
    Dialect,
    DialectError,
    HarnessRequest,
    LocalContext,
    load_json_object,
    optional,
    require,
)
from .blocks import BlockStream
from .convert import (
    ChatBuilder,
    arguments_json,
    content_of,
    function_tool,
    image_part,
    new_id,
    number,
    positive_int,
    safe_id,
    seal,
    text_part,
    unseal,
)
from .usage import anthropic_usage, counts

# Claude Code's first system block: per-request billing metadata (its `cch=` changes every call),
# not instructions. Rendered, it would make every prompt differ from the previous call's prefix.
BILLING_HEADER = "x-anthropic-billing-header:"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_SIDE_HINTS = (
    ("title", re.compile(r"\btitle\b", re.I)),
    ("summary", re.compile(r"\bsummar(y|ize|ise)\b", re.I)),
)


class AnthropicMessages(Dialect):
    name = "anthropic_messages"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and (
            path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens")
        )

    def parse(self, body: bytes, path: str) -> HarnessRequest:
        data = load_json_object(body)
        counting = path.endswith("/count_tokens")
        model = optional(data, "model", str, "a string") or ""
        stream = bool(optional(data, "stream", bool, "a boolean")) and not counting
        raw_messages = require(data, "messages", list, "a list of messages")
        if not raw_messages:
            raise DialectError("'messages' must not be empty")
        notes: list[str] = []
        builder = ChatBuilder()
        system = _system_text(data.get("system"), notes)
        if system:
            builder.system(system)
        loaded: set[str] = set()  # deferred tools a tool_reference made available
        for i, message in enumerate(raw_messages):
            _add_message(builder, message, f"messages[{i}]", loaded, notes)
        chat: dict[str, Any] = {"messages": builder.result()}
        raw_tools = optional(data, "tools", list, "a list of tools") or []
        tools = []
        for i, raw in enumerate(raw_tools):
            tool = _tool(raw, f"tools[{i}]")
            if raw.get("defer_loading") and raw.get("name") not in loaded:
                notes.append(f"deferred tool not offered: {raw.get('name')}")
            else:
                tools.append(tool)
        if tools:
            chat["tools"] = tools
        choice, parallel = _tool_choice(data.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is False and tools:
            chat["parallel_tool_calls"] = False
        max_tokens = positive_int(data, "max_tokens")
        if max_tokens is not None and not counting:
            chat["max_tokens"] = max_tokens
        for key, high in (("temperature", 1.0), ("top_p", 1.0)):
            value = number(data, key, 0.0, high)
            if value is not None:
                chat[key] = value
        top_k = positive_int(data, "top_k")
        if top_k is not None:
            chat["top_k"] = top_k  # vLLM's and SGLang's sampling extension
        stops = optional(data, "stop_sequences", list, "a list of strings")
        if stops:
            if not all(isinstance(s, str) for s in stops):
                raise DialectError("'stop_sequences' must be a list of strings")
            chat["stop"] = stops
        thinking = optional(data, "thinking", dict, "an object") or {}
        kwargs: dict[str, Any] = {}
        if thinking:
            kind = thinking.get("type")
            if kind not in ("enabled", "adaptive", "disabled"):
                raise DialectError("'thinking.type' must be enabled, adaptive or disabled")
            kwargs["enable_thinking"] = kind != "disabled"
        effort = (optional(data, "output_config", dict, "an object") or {}).get("effort")
        if isinstance(effort, str):
            kwargs["reasoning_effort"] = effort
        if kwargs:
            chat["chat_template_kwargs"] = kwargs
        return HarnessRequest(
            body=data,
            model=model,
            stream=stream,
            chat=chat,
            purpose="count_tokens" if counting else _purpose(data, system),
            local=counting,
            extra={"stops": stops or [], "show_thinking": thinking.get("display") != "omitted"},
            notes=notes,
        )

    def reply(self, req: HarnessRequest, chat_reply: dict[str, Any]) -> dict[str, Any]:
        return _MessagesStream(req, live=False).run(reply_to_chunks(chat_reply))

    def stream(self, req: HarnessRequest) -> _MessagesStream:
        return _MessagesStream(req)

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": error_type(status, kind), "message": message}}

    def local_reply(self, req: HarnessRequest, local: LocalContext) -> dict[str, Any]:
        return {"input_tokens": local.prompt_tokens(req.chat)}


def error_type(status: int, kind: str) -> str:
    """Anthropic's error type for a status (the SDKs pick their exception class by status)."""
    if kind in _ERROR_TYPES.values():
        return kind
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def _purpose(data: dict[str, Any], system: str) -> str:
    """`main`, or for a tool-less call of Claude Code (its side calls carry no tools, its main
    loop and sub-agents always do) what it is for: `title`, `summary` or `side`; Claude Code's
    own compaction (tools or not) is `compaction` (dialects/compaction.py)."""
    if compaction.is_claude_compaction(_last_user_text(data.get("messages"))):
        return compaction.PURPOSE
    if data.get("tools") or not _is_claude_code(data, system):
        return "main"
    for purpose, hint in _SIDE_HINTS:
        if hint.search(system):
            return purpose
    return "side"


def _last_user_text(messages: Any) -> str:
    """The text of the last user message (its text blocks, joined)."""
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(
                    b["text"]
                    for b in content
                    if isinstance(b, dict) and isinstance(b.get("text"), str)
                )
            return ""
    return ""


def _is_claude_code(data: dict[str, Any], system: str) -> bool:
    user = (data.get("metadata") or {}).get("user_id")
    return "Claude Code" in system or (isinstance(user, str) and "session" in user)


def _system_text(system: Any, notes: list[str], where: str = "system") -> str:
    if system is None or system == "":
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise DialectError(f"'{where}' must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise DialectError(f"{where}[{i}] must be a text block")
        text = str(block.get("text") or "")
        if text.startswith(BILLING_HEADER):
            notes.append(f"dropped {where}[{i}]: {BILLING_HEADER} block")
            continue
        texts.append(text)
    return "\n".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DialectError(f"{where} must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise DialectError(f"{where}[{j}] must be an object with a string 'type'")
    return content


def _add_message(
    builder: ChatBuilder, message: Any, where: str, loaded: set[str], notes: list[str]
) -> None:
    if not isinstance(message, dict):
        raise DialectError(f"{where} must be an object")
    role = message.get("role")
    if role == "system":  # not in Anthropic's API, but Claude Code sends one (its environment)
        builder.system(_system_text(message.get("content"), notes, f"{where}.content"))
        return
    blocks = _blocks(message.get("content"), f"{where}.content")
    if role == "assistant":
        for j, block in enumerate(blocks):
            _assistant_block(builder, block, f"{where}.content[{j}]", notes)
        if not blocks:
            builder.assistant_text("")
        builder.end_turn()
    elif role == "user":
        parts: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if block["type"] == "tool_result":
                if parts:
                    builder.user(content_of(parts))
                    parts = []
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise DialectError(f"{at} needs a string 'tool_use_id'")
                builder.tool_result(call_id, _result_content(block.get("content"), at, loaded))
            else:
                parts.append(_user_part(block, at))
        if parts or not blocks:
            builder.user(content_of(parts))
    else:
        raise DialectError(f"{where}.role must be 'user' or 'assistant'")


def thinking_text(block: dict[str, Any]) -> str:
    """A thinking block's text, or the copy sealed in its signature (`display: omitted` replies
    carry the thinking only there, and Claude Code sends them back that way)."""
    text = block.get("thinking")
    if text:
        return str(text)
    return unseal(block.get("signature")) or ""


def _assistant_block(
    builder: ChatBuilder, block: dict[str, Any], where: str, notes: list[str]
) -> None:
    kind = block["type"]
    if kind == "text":
        builder.assistant_text(str(block.get("text") or ""))
    elif kind == "thinking":
        thinking = thinking_text(block)
        if thinking:
            builder.reasoning(thinking)
    elif kind == "redacted_thinking":  # Anthropic's own ciphertext: nothing the policy can read
        notes.append(f"skipped {where}: redacted_thinking")
    elif kind == "tool_use":
        call_id, name = block.get("id"), block.get("name")
        if not isinstance(call_id, str) or not isinstance(name, str) or not name:
            raise DialectError(f"{where}: tool_use needs a string 'id' and 'name'")
        builder.tool_call(call_id, name, arguments_json(block.get("input") or {}))
    else:
        raise DialectError(f"{where}: assistant block type {kind!r} is not supported by polar-mitm")


def _user_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    kind = block["type"]
    if kind == "text":
        return text_part(str(block.get("text") or ""))
    if kind == "image":
        return image_part(_image_url(block.get("source"), where))
    if kind == "document":
        source = block.get("source") or {}
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            return text_part(source["data"])
        if source.get("type") == "content" and isinstance(source.get("content"), str):
            return text_part(source["content"])
        raise DialectError(f"{where}: only plain-text documents are supported (not PDFs or files)")
    raise DialectError(f"{where}: user block type {kind!r} is not supported by polar-mitm")


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict):
        if source.get("type") == "base64" and source.get("data"):
            media = source.get("media_type") or "image/png"
            return f"data:{media};base64,{source['data']}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
    raise DialectError(f"{where}: an image needs a base64 or url 'source'")


def _result_content(content: Any, where: str, loaded: set[str]) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for k, block in enumerate(_blocks(content, where)):
        if block["type"] == "tool_reference":  # ToolSearch found a deferred tool: offer it
            name = block.get("tool_name")
            if not isinstance(name, str) or not name:
                raise DialectError(f"{where}.content[{k}]: tool_reference needs a 'tool_name'")
            loaded.add(name)
            parts.append(text_part(name))
        else:
            parts.append(_user_part(block, f"{where}.content[{k}]"))
    return content_of(parts)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise DialectError(f"{where} must be an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise DialectError(
            f"{where}: server tool {kind!r} is not supported: nothing behind polar-mitm can run it"
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise DialectError(f"{where} needs a string 'name'")
    schema = tool.get("input_schema")
    if schema is not None and not isinstance(schema, dict):
        raise DialectError(f"{where}.input_schema must be an object")
    description = tool.get("description")
    text = description if isinstance(description, str) else None
    return function_tool(name, text, schema, tool.get("strict"))


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise DialectError("'tool_choice' must be an object")
    parallel = None if not choice.get("disable_parallel_tool_use") else False
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise DialectError("'tool_choice.type' must be auto, any, tool (with a name) or none")


class _MessagesStream(BlockStream):
    """Chat chunks -> Anthropic events (and, at the end, the whole `message` object)."""

    def __init__(self, req: HarnessRequest, live: bool = True) -> None:
        super().__init__()
        self.req = req
        self.live = live
        self.id = new_id("msg_")
        self.content: list[dict[str, Any]] = []
        self.pieces: list[str] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.final_usage: dict[str, Any] = {}
        self.show_thinking = req.extra.get("show_thinking", True)

    def event(self, kind: str, payload: dict[str, Any]) -> None:
        if self.live:
            payload["type"] = kind
            self.emit(encode_json(payload, kind))

    def _start_block(self, block: dict[str, Any]) -> None:
        self.pieces = []
        self.event("content_block_start", {"index": len(self.content), "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.event("content_block_delta", {"index": len(self.content), "delta": delta})

    def _stop_block(self, block: dict[str, Any]) -> None:
        self.event("content_block_stop", {"index": len(self.content)})
        self.content.append(block)

    # -- hooks ---------------------------------------------------------------------------------

    def on_start(self, first_chunk: dict[str, Any]) -> None:
        usage = anthropic_usage(counts(None, self.prompt_tokens))
        message = self._message([], usage)
        self.event("message_start", {"message": message})
        self.event("ping", {})

    def on_open_reasoning(self) -> None:
        self._start_block({"type": "thinking", "thinking": "", "signature": ""})

    def on_reasoning(self, text: str) -> None:
        self.pieces.append(text)
        if self.show_thinking:
            self._delta({"type": "thinking_delta", "thinking": text})

    def on_close_reasoning(self) -> None:
        thinking = "".join(self.pieces)
        signature = seal(thinking)
        self._delta({"type": "signature_delta", "signature": signature})
        shown = thinking if self.show_thinking else ""
        self._stop_block({"type": "thinking", "thinking": shown, "signature": signature})

    def on_open_text(self) -> None:
        self._start_block({"type": "text", "text": ""})

    def on_text(self, text: str, logprobs: Any) -> None:
        self.pieces.append(text)
        self._delta({"type": "text_delta", "text": text})

    def on_close_text(self) -> None:
        self._stop_block({"type": "text", "text": "".join(self.pieces)})

    def on_open_tool(self, tool: ToolCallParts) -> None:
        tool.id = safe_id(tool.id, "toolu_")
        self._start_block({"type": "tool_use", "id": tool.id, "name": tool.name, "input": {}})

    def on_tool_arguments(self, tool: ToolCallParts, delta: str) -> None:
        self._delta({"type": "input_json_delta", "partial_json": delta})

    def on_close_tool(self, tool: ToolCallParts) -> None:
        try:
            value = json.loads(tool.arguments) if tool.arguments.strip() else {}
        except (json.JSONDecodeError, ValueError):
            value = {}  # the policy wrote invalid JSON; the stream already carried it as it was
        self._stop_block({"type": "tool_use", "id": tool.id, "name": tool.name, "input": value})

    def on_end(self) -> None:
        finish = self.finish_reason or "stop"
        reason = _STOP_REASONS.get(finish, "end_turn")
        if self.calls and reason == "end_turn":
            reason = "tool_use"
        match = self.stop_match
        if finish == "stop" and isinstance(match, str) and match in self.req.extra.get("stops", ()):
            reason, self.stop_sequence = "stop_sequence", match
        self.stop_reason = reason
        usage = anthropic_usage(counts(self.usage, self.prompt_tokens))
        self.final_usage = usage
        self.event(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": self.stop_sequence}, "usage": usage},
        )
        self.event("message_stop", {})

    def on_fail(self, message: str, kind: str) -> None:
        self.event("error", {"error": {"type": error_type(0, kind), "message": message}})

    def _message(self, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model or "",
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": usage,
        }

    def final(self) -> dict[str, Any]:
        return self._message(self.content, self.final_usage)
