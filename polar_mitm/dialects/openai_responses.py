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

Responses is the largest API both ways, so it is two modules: this one reads the request (items,
tool namespaces and custom tools on the way in); `responses_stream.py` writes the reply (reasoning
/ custom-tool / incomplete events on the way out), and holds the tool naming both share
(`ToolRef`). What every dialect shares is in `base`, `blocks`, `convert`, `assemble`.
"""

from __future__ import annotations

from typing import Any

from . import compaction
from .assemble import reply_to_chunks
from .base import Dialect, DialectError, HarnessRequest, load_json_object, optional
from .convert import (
    ChatBuilder,
    arguments_json,
    content_of,
    function_tool,
    image_part,
    number,
    positive_int,
    text_part,
    unseal,
)
from .responses_stream import ResponsesStream, ToolRef, error_code, translator

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
        return translator(req, live=False).run(reply_to_chunks(chat_reply))

    def stream(self, req: HarnessRequest) -> ResponsesStream:
        return translator(req)

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": None,
                "code": error_code(status, message, kind),
            }
        }


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
