"""OpenAI Responses (`POST .../responses`): what Codex CLI speaks.

vLLM's own `/v1/responses` returns no token ids, so a Responses request becomes a chat-completions
request upstream and the chat stream becomes Responses events again, as they arrive.

Request (`parse`):
* `instructions` is the first system message; `developer` and `system` messages are system
  messages (Qwen3's template drops any other role without a word);
* history items — `message`, `reasoning`, `function_call`, `custom_tool_call` — that follow one
  another form one assistant turn (see `convert.ChatBuilder`); `function_call_output` and
  `custom_tool_call_output` are tool messages; other item types are refused with a 400 that
  names them (`item_reference`, `previous_response_id` and `conversation` need stored responses,
  which a proxy with `store: false` harnesses never has);
* tools come from `tools` and from `additional_tools` input items (Codex puts them there); tools
  inside a `namespace` are offered as `<namespace>.<name>`, except in the default `functions`
  namespace (Codex's `exec`), whose tools keep their bare names; a custom (freeform) tool is offered as
  a function with one string argument, `input`, its grammar quoted in the description; hosted
  tools the policy cannot run (web search, file search, ...) are not offered;
* `reasoning.effort` becomes `chat_template_kwargs` (`enable_thinking` false only for `none`).

Reply: reasoning becomes a `reasoning` item whose text is in `content` (`reasoning_text`) and,
when the harness asks for `reasoning.encrypted_content` (Codex always does), also in
`encrypted_content` (`convert.seal`: base64, not encrypted), so it comes back next turn even
from clients that drop the plain text. A call of a custom tool becomes a `custom_tool_call`
whose `input` is the `input` argument (streamed as `custom_tool_call_input.delta` while it is
being written); `length` ends the stream with `response.incomplete` (`max_output_tokens`), as
OpenAI does; an upstream failure mid-stream ends it with `response.failed`.

Over 500 lines because a dialect is one module (so a new harness API is one new file) and
Responses is the largest API both ways: request items, tool namespaces and custom tools on the
way in, reasoning / custom-tool / incomplete events on the way out, sharing one tool naming
(`_Tools`, `ToolRef`). What every dialect shares is in `base`, `blocks`, `convert`, `assemble`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from ..core.sse import encode_json
from . import compaction
from .assemble import ToolCallParts, reply_to_chunks
from .base import Dialect, DialectError, HarnessRequest, load_json_object, optional
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
from .usage import counts, responses_usage

# Tools run by OpenAI's servers: nothing behind this proxy can run them, so they are not offered.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer",
        "mcp",
        "tool_search",
        "local_shell",
        "shell",
        "apply_patch",
    }
)
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_CUSTOM_INPUT_SCHEMA = {
    "type": "object",
    "properties": {
        "input": {
            "type": "string",
            "description": "The tool's whole input, as free text (not JSON).",
        }
    },
    "required": ["input"],
    "additionalProperties": False,
}
# The endpoint older Codex clients compact with (a JSON reply, not a stream).
COMPACT_PATH = "/responses/compact"
_CONTEXT_TOO_LONG = re.compile(r"maximum context length|context length|too many tokens", re.I)


@dataclass(frozen=True, slots=True)
class ToolRef:
    """How a tool the policy sees maps back to the harness's tool."""

    kind: str  # "function" | "custom"
    name: str
    namespace: str | None = None


# The namespace of plain function tools: Codex puts `exec` in it and sends its calls back
# without a namespace, so its tools are offered (and answered) by their bare names.
DEFAULT_NAMESPACE = "functions"


def flat_name(namespace: str | None, name: str) -> str:
    """The function name the policy sees for a (namespace, name) tool."""
    return f"{namespace}.{name}" if namespace and namespace != DEFAULT_NAMESPACE else name


class _Tools:
    """The harness's tools (top-level and `additional_tools`) as chat function tools."""

    def __init__(self) -> None:
        self.chat: dict[str, dict[str, Any]] = {}  # flat name -> chat tool, in first-seen order
        self.refs: dict[str, ToolRef] = {}
        self.notes: list[str] = []

    def add_all(self, tools: Any, where: str) -> None:
        if not isinstance(tools, list):
            raise DialectError(f"'{where}' must be a list of tools")
        for i, tool in enumerate(tools):
            self.add(tool, f"{where}[{i}]")

    def add(
        self, tool: Any, where: str, namespace: str | None = None, ns_description: str = ""
    ) -> None:
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise DialectError(f"{where} must be an object with a string 'type'")
        kind = tool["type"]
        if kind == "namespace" and namespace is None:
            ns = tool.get("name")
            if not isinstance(ns, str) or not ns:
                raise DialectError(f"{where}: a namespace needs a string 'name'")
            children = tool.get("tools")
            if not isinstance(children, list):
                raise DialectError(f"{where}: a namespace needs a list of 'tools'")
            about = tool.get("description") if isinstance(tool.get("description"), str) else ""
            for j, child in enumerate(children):
                self.add(child, f"{where}.tools[{j}]", ns, about)
            return
        if kind in HOSTED_TOOLS:
            self.notes.append(f"hosted tool not offered: {kind}")
            return
        if kind not in ("function", "custom"):
            raise DialectError(f"{where}: tool type {kind!r} is not supported by polar-mitm")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise DialectError(f"{where}: a {kind} tool needs a string 'name'")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise DialectError(f"{where}.description must be a string")
        if ns_description:  # the namespace's own description, once per tool the policy sees
            description = f"{ns_description}\n\n{description}" if description else ns_description
        flat = flat_name(namespace, name)
        if kind == "function":
            chat = function_tool(flat, description, tool.get("parameters"), tool.get("strict"))
        else:
            chat = function_tool(
                flat, _custom_description(description, tool.get("format")), _CUSTOM_INPUT_SCHEMA
            )
        self.chat[flat] = chat
        self.refs[flat] = ToolRef(kind, name, None if namespace == DEFAULT_NAMESPACE else namespace)

    def flat(self, item: dict[str, Any], where: str) -> str:
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise DialectError(f"{where} needs a string 'name'")
        namespace = item.get("namespace")
        return flat_name(namespace if isinstance(namespace, str) else None, name)


def _custom_description(description: str | None, fmt: Any) -> str:
    text = description or ""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax = fmt.get("syntax") or "lark"
        text += f"\n\nThe input must match this {syntax} grammar:\n{fmt['definition']}"
    return text.strip()


def reasoning_text(item: dict[str, Any]) -> str:
    """The thinking a `reasoning` item carries: its raw text, else our sealed copy, else the
    summary (an OpenAI model's reasoning reaches us only summarized)."""
    content = item.get("content")
    if isinstance(content, list):
        texts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        if texts:
            return "\n".join(texts)
    sealed = unseal(item.get("encrypted_content"))
    if sealed is not None:
        return sealed
    summary = item.get("summary")
    if isinstance(summary, list):
        return "\n".join(
            p["text"] for p in summary if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _parts(content: Any, where: str, images: bool = True) -> str | list[dict[str, Any]]:
    """Message or tool-output content: a string, or a list of text / image parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise DialectError(f"{where}[{j}] must be an object")
        kind = part.get("type")
        if isinstance(kind, str) and kind in _TEXT_PARTS:
            parts.append(text_part(str(part.get("text") or "")))
        elif kind == "refusal":
            parts.append(text_part(str(part.get("refusal") or "")))
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise DialectError(
                    f"{where}[{j}]: input_image needs an 'image_url' (file_id images need the "
                    "Files API, which polar-mitm does not serve)"
                )
            parts.append(image_part(url))
        else:
            raise DialectError(f"{where}[{j}]: content part type {kind!r} is not supported")
    return content_of(parts)


def _text_only(content: Any, where: str) -> str:
    value = _parts(content, where, images=False)
    assert isinstance(value, str)
    return value


class OpenAIResponses(Dialect):
    name = "openai_responses"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and (path.endswith("/responses") or path.endswith(COMPACT_PATH))

    def parse(self, body: bytes, path: str) -> HarnessRequest:
        data = load_json_object(body)
        for key in ("previous_response_id", "conversation", "prompt"):
            if data.get(key):
                raise DialectError(
                    f"'{key}' is not supported: polar-mitm keeps no stored responses; send the "
                    "whole conversation in 'input' (store: false)"
                )
        if data.get("background"):
            raise DialectError("'background' responses are not supported")
        model = optional(data, "model", str, "a string") or ""
        compact_endpoint = path.endswith(COMPACT_PATH)  # answered with one JSON body
        stream = bool(optional(data, "stream", bool, "a boolean")) and not compact_endpoint
        tools = _Tools()
        tools.add_all(data.get("tools") or [], "tools")
        builder = ChatBuilder()
        instructions = optional(data, "instructions", str, "a string")
        if instructions:
            builder.system(instructions)
        items = data.get("input")
        compacting = compact_endpoint
        if isinstance(items, str):
            builder.user(items)
        elif isinstance(items, list):
            for i, item in enumerate(items):
                if compaction.is_trigger(item):
                    if i != len(items) - 1:
                        raise DialectError(f"input[{i}]: compaction_trigger must be the last item")
                    compacting = True
                    continue
                _add_item(builder, tools, item, f"input[{i}]")
        else:
            raise DialectError("'input' is required: a string or a list of items")
        if compacting:  # the policy writes the summary (polar_mitm/dialects/compaction.py)
            builder.user(compaction.INSTRUCTION)
        messages = builder.result()
        if not messages:
            raise DialectError("'input' must hold at least one message")
        chat: dict[str, Any] = {"messages": messages}
        if tools.chat:
            chat["tools"] = list(tools.chat.values())
        choice = _tool_choice(data.get("tool_choice"), tools)
        if choice is not None:
            chat["tool_choice"] = choice
        parallel = optional(data, "parallel_tool_calls", bool, "a boolean")
        if parallel is not None and tools.chat:
            chat["parallel_tool_calls"] = parallel
        max_tokens = positive_int(data, "max_output_tokens")
        if max_tokens is not None:
            chat["max_tokens"] = max_tokens
        for key, high in (("temperature", 2.0), ("top_p", 1.0)):
            value = number(data, key, 0.0, high)
            if value is not None:
                chat[key] = value
        reasoning = optional(data, "reasoning", dict, "an object") or {}
        effort = reasoning.get("effort")
        if isinstance(effort, str):
            chat["chat_template_kwargs"] = {
                "enable_thinking": effort != "none",
                "reasoning_effort": effort,
            }
        fmt = _response_format((optional(data, "text", dict, "an object") or {}).get("format"))
        if fmt is not None:
            chat["response_format"] = fmt
        include = optional(data, "include", list, "a list of strings") or []
        top = optional(data, "top_logprobs", int, "an integer between 0 and 20") or 0
        if not 0 <= top <= 20:
            raise DialectError("'top_logprobs' must be an integer between 0 and 20")
        return HarnessRequest(
            body=data,
            model=model,
            stream=stream,
            chat=chat,
            wants_logprobs="message.output_text.logprobs" in include,
            top_logprobs=top,
            purpose=compaction.PURPOSE if compacting else "main",
            extra={
                "tools": tools.refs,
                "seal": "reasoning.encrypted_content" in include,
                "compaction": "endpoint" if compact_endpoint else "trigger" if compacting else None,
            },
            notes=tools.notes,
        )

    def reply(self, req: HarnessRequest, chat_reply: dict[str, Any]) -> dict[str, Any]:
        return _translator(req, live=False).run(reply_to_chunks(chat_reply))

    def stream(self, req: HarnessRequest) -> _ResponsesStream:
        return _translator(req)

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": None,
                "code": _error_code(status, message, kind),
            }
        }


def _error_code(status: int, message: str, kind: str) -> str | None:
    """OpenAI's error codes that Codex acts on (it compacts on context_length_exceeded)."""
    if _CONTEXT_TOO_LONG.search(message) and (status == 400 or kind == "invalid_request_error"):
        return "context_length_exceeded"
    if status == 429 or kind == "rate_limit_error":
        return "rate_limit_exceeded"
    return None


def _add_item(builder: ChatBuilder, tools: _Tools, item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise DialectError(f"{where} must be an object")
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        role = item.get("role")
        if role in ("system", "developer"):
            builder.system(_text_only(item.get("content"), f"{where}.content"))
        elif role == "user":
            builder.user(_parts(item.get("content"), f"{where}.content"))
        elif role == "assistant":
            builder.assistant_text(_text_only(item.get("content"), f"{where}.content"))
        else:
            raise DialectError(f"{where}.role must be user, assistant, system or developer")
    elif kind == "reasoning":
        text = reasoning_text(item)
        if text:
            builder.reasoning(text)
    elif kind in ("function_call", "custom_tool_call"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise DialectError(f"{where} needs a string 'call_id'")
        if kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise DialectError(f"{where}.arguments must be a string")
        else:
            value = item.get("input")
            if not isinstance(value, str):
                raise DialectError(f"{where}.input must be a string")
            arguments = arguments_json({"input": value})
        builder.tool_call(call_id, tools.flat(item, where), arguments)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise DialectError(f"{where} needs a string 'call_id'")
        builder.tool_result(call_id, _parts(item.get("output"), f"{where}.output"))
    elif kind == "additional_tools":
        tools.add_all(item.get("tools"), f"{where}.tools")
    elif kind == "agent_message":  # Codex multi-agent: a task or an answer from another agent
        builder.user(_agent_message(item, where))
    elif compaction.is_summary_item(item):
        try:
            builder.user(compaction.summary_message(unseal(item.get("encrypted_content"))))
        except compaction.CompactionError as e:
            raise DialectError(f"{where}: {e}") from None
    elif kind == "item_reference":
        raise DialectError(
            f"{where}: item_reference needs stored responses, which polar-mitm does not keep; "
            "send the items themselves"
        )
    else:
        raise DialectError(
            f"{where}: input item type {kind!r} is not supported by polar-mitm "
            "(it has no chat-completions form for the policy)"
        )


def _agent_message(item: dict[str, Any], where: str) -> str:
    """The text of a Codex `agent_message` (`author` -> `recipient`), as the user turn it is for
    the policy. Its payload part is `encrypted_content` because the real API encrypts the
    `message` argument of `spawn_agent`; behind polar-mitm the policy wrote that argument, so the
    value is its own text (or our sealed form of it) and is shown as it is."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise DialectError(f"{where}.content[{j}] must be an object")
        if part.get("type") == "encrypted_content":
            value = part.get("encrypted_content")
            texts.append(unseal(value) or (value if isinstance(value, str) else ""))
        else:
            texts.append(_text_only([part], f"{where}.content"))
    return "".join(texts)


def _tool_choice(choice: Any, tools: _Tools) -> Any:
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom"):
            return {"type": "function", "function": {"name": tools.flat(choice, "tool_choice")}}
        if kind == "allowed_tools":  # chat completions cannot narrow the set: keep the mode
            mode = choice.get("mode", "auto")
            return mode if mode in ("auto", "required") else "auto"
    raise DialectError(f"'tool_choice' {choice!r} is not supported by polar-mitm")


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise DialectError(f"'text.format' type {fmt['type']!r} is not supported")


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


class _ResponsesStream(BlockStream):
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
        code = _error_code(0, message, kind) or "server_error"
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


class _CompactionStream(_ResponsesStream):
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


def _translator(req: HarnessRequest, live: bool = True) -> _ResponsesStream:
    if req.extra.get("compaction"):
        return _CompactionStream(req, live)
    return _ResponsesStream(req, live)
