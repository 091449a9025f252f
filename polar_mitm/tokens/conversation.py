"""The conversation a policy server hands its chat template, exactly as that server builds it.

Prompt ids depend on more than the messages: each server first normalizes the request (content
parts, tool-call arguments, prior reasoning, the tools list) and then renders its chat template.
The reference policy server (to compute the ids a real server would) and the proxy's no-ids
fallback (`tokens/retokenize.py`, to recompute them) must normalize identically, so both use this one
module. Two flavors, for a *string-content* template such as Qwen3's:

vLLM (``vllm/entrypoints/chat_utils.py``: ``_parse_chat_message_content``, ``_postprocess_messages``;
tools are ``ChatCompletionToolsParam.model_dump()``):

* text content parts (``text``/``input_text``/``output_text``, ``refusal``, ``thinking``) are joined
  with ``"\\n"``; missing or ``null`` content becomes ``""``;
* an assistant message's ``reasoning`` (or the deprecated ``reasoning_content``, which vLLM renames on
  input) is handed to the template as both ``reasoning`` and ``reasoning_content``;
* assistant ``tool_calls`` with JSON-string ``arguments`` are parsed to objects (invalid JSON -> ``{}``),
  an empty ``tool_calls`` list is dropped;
* every other message key but ``name`` and a tool message's ``tool_call_id`` is dropped;
* each tool becomes ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
  ``null`` for a missing description/parameters, as pydantic's ``model_dump`` writes them.

SGLang (``python/sglang/srt/entrypoints/openai/serving_chat.py`` ``_apply_jinja_template`` and
``parser/jinja_template_utils.py`` ``process_content_for_template_format``, main as of 2026-06..08;
see docs/upstreams.md):

* each message is the pydantic dump of ``ChatCompletionMessageGenericParam`` (``role, content,
  tool_call_id, name, reasoning_content, tool_calls, tools``) with ``None`` values dropped: an
  assistant's ``reasoning`` is *not* a field and is lost, only ``reasoning_content`` reaches the template;
* ``null`` content becomes ``""``; text parts (``text``, ``input_text``) are joined with ``" "``
  (a space, not vLLM's newline), other parts (thinking, images) are dropped for a string template;
* assistant tool-call ``arguments`` strings must be JSON objects (else 400) and are parsed; each call
  is dumped as ``{"id", "index", "type", "function": {"name", "arguments"}}``;
* a final assistant message (without ``continue_final_message``) is turned into a user message;
* tools reach the template only when ``tool_choice`` is not ``"none"`` (a named choice keeps only that
  tool), each as ``Tool.model_dump()``: ``{"type", "function": {"description", "name", "parameters",
  "strict"}, "defer_loading"}`` — so Qwen3's ``tool | tojson`` renders ``"strict": false`` and
  ``"defer_loading": null``;
* template variables: ``chat_template_kwargs`` (``thinking``/``enable_thinking`` defaulted from
  ``reasoning_effort`` or ``reasoning.enabled``) plus ``reasoning_effort`` itself; the generation prompt
  is always added.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Flavor = Literal["vllm", "sglang"]
FLAVORS: tuple[str, ...] = ("vllm", "sglang")

_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# apply_chat_template's own parameters: a chat_template_kwargs key with one of these names would change
# what transformers does rather than reach the template, which neither server does.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
}


class RequestError(ValueError):
    """The request cannot be rendered (vLLM answers these with 400 BadRequestError)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise RequestError(f"{where}.content parts must be objects", param="messages")
        key = _TEXT_PART_KEYS.get(part.get("type", "text"))
        if key is None:
            raise RequestError(
                f"Unsupported chat content part type: {part.get('type')!r} "
                "(the reference policy server renders text only).",
                param="type",
            )
        text = part.get(key)
        if text is None:  # vLLM skips text parts without text
            continue
        texts.append(str(text))
    return "\n".join(texts)


def _normalize_tool_call(call: Any) -> Any:
    # Copies of the two levels changed here; the rest is shared, never mutated (a deep copy
    # was most of the cost of normalizing a long agent conversation).
    if not isinstance(call, dict):
        return copy.deepcopy(call)
    call = dict(call)
    function = call.get("function")
    if isinstance(function, dict):
        function = call["function"] = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
    return call


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """vLLM's conversation for a string-content template (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'", param="messages")
        role = message["role"]
        out: dict[str, Any] = {
            "role": role,
            "content": _content_text(message.get("content"), where),
        }
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                out["tool_calls"] = [_normalize_tool_call(c) for c in tool_calls]
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = str(reasoning)
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    return conversation


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` as vLLM hands tools to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise RequestError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{i}] must be a function tool", param="tools")
        if not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}].function.name must be a string", param="tools")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                fn[optional] = function[optional]
        entry: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def template_kwargs(chat_template_kwargs: Any, reasoning_effort: Any = None) -> dict[str, Any]:
    """The extra template variables vLLM passes: the request's ``chat_template_kwargs`` (minus
    ``apply_chat_template``'s own parameter names) and ``enable_thinking`` derived from
    ``reasoning_effort`` when the request did not set it (newer vLLM)."""
    if chat_template_kwargs is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(chat_template_kwargs, Mapping):
        kwargs = {
            k: v for k, v in chat_template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS
        }
    else:
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = reasoning_effort != "none"
    return kwargs


@dataclass(frozen=True)
class RenderInput:
    """Everything that determines a prompt: normalized, so equal inputs hash equally."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def key(self) -> str:
        blob = json.dumps(
            [
                self.messages,
                self.tools,
                self.kwargs,
                self.add_generation_prompt,
                self.continue_final_message,
            ],
            sort_keys=True,
            ensure_ascii=False,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def vllm_render_input(body: Mapping[str, Any]) -> RenderInput:
    """What vLLM hands its chat template for a chat-completions body."""
    return RenderInput(
        messages=normalize_messages(body.get("messages")),
        tools=normalize_tools(body.get("tools")),
        kwargs=template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort")),
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        continue_final_message=bool(body.get("continue_final_message", False)),
    )


# -- SGLang ----------------------------------------------------------------------------------

_SGLANG_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "user")
# The content-part types SGLang's request model accepts; only the text ones reach a string template.
_SGLANG_PART_TYPES = {
    "text",
    "thinking",
    "reasoning",
    "image_url",
    "video_url",
    "audio_url",
    "tool_reference",
}


def _sglang_content(content: Any, role: str, where: str) -> str:
    if content is None:
        if role == "user":
            raise RequestError(f"{where}.content is required for a user message", param="messages")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", param="messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _SGLANG_PART_TYPES:
            raise RequestError(f"{where}.content: unsupported part type {kind!r}", param="messages")
        if kind in ("thinking", "reasoning") and role != "assistant":
            raise RequestError(
                "thinking content parts are only valid in assistant messages", param="messages"
            )
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"{where}.content: a text part needs a string 'text'", "messages"
                )
            texts.append(part["text"])
    return " ".join(texts)


def _sglang_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise RequestError(f"{where}: a tool call needs a function", param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise RequestError(
                "Assistant tool call function.arguments must be valid JSON.", "messages"
            ) from None
        if not isinstance(arguments, dict):
            raise RequestError(
                "Assistant tool call function.arguments must be a JSON object.", "messages"
            )
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": copy.deepcopy(arguments)},
    }


def sglang_messages(messages: Any, final_assistant_to_user: bool = True) -> list[dict[str, Any]]:
    """SGLang's conversation for a string-content template (see the module docstring).

    ``final_assistant_to_user=False`` keeps a trailing assistant message as it is: the fallback
    renders the reply after the prompt to find the text the model wrote.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("Messages cannot be empty.", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str) or role.lower() not in _SGLANG_ROLES:
            allowed = ", ".join(repr(r) for r in _SGLANG_ROLES)
            raise RequestError(f"{where}: 'role' must be one of {allowed}", param="messages")
        role = role.lower()
        out: dict[str, Any] = {
            "role": role,
            "content": _sglang_content(message.get("content"), role, where),
        }
        if role != "user":
            for key in ("tool_call_id", "name", "reasoning_content"):
                value = message.get(key)
                if value is not None:
                    if not isinstance(value, str):
                        raise RequestError(f"{where}.{key} must be a string", param="messages")
                    out[key] = value
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise RequestError(f"{where}.tool_calls must be a list", param="messages")
                if role == "assistant":
                    calls = [
                        _sglang_tool_call(c, f"{where}.tool_calls[{j}]")
                        for j, c in enumerate(calls)
                    ]
                out["tool_calls"] = calls
            if message.get("tools") is not None:
                out["tools"] = sglang_tools(message["tools"], "auto")
        conversation.append(out)
    last = conversation[-1]
    if final_assistant_to_user and last["role"] == "assistant":
        conversation[-1] = {"role": "user", "content": last["content"]}
    return conversation


def sglang_tool_choice(body: Mapping[str, Any]) -> Any:
    """``tool_choice`` after SGLang's default: ``auto`` with tools, ``none`` without."""
    choice = body.get("tool_choice")
    if choice is None:
        has_tools = bool(body.get("tools")) or any(
            isinstance(m, Mapping)
            and str(m.get("role", "")).lower() in ("system", "developer")
            and m.get("tools")
            for m in body.get("messages") or ()
        )
        return "auto" if has_tools else "none"
    return choice


def sglang_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` as SGLang hands tools to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    dumped = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must have a function with a string name", "tools")
        fn: dict[str, Any] = {
            "description": function.get("description"),
            "name": function["name"],
            "parameters": function.get("parameters"),
            "strict": bool(function.get("strict") or False),
        }
        defer = function.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        dumped.append(
            {
                "type": tool.get("type", "function"),
                "function": fn,
                "defer_loading": tool.get("defer_loading"),
            }
        )
    if not dumped or tool_choice == "none":
        return None
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        dumped = [t for t in dumped if t["function"]["name"] == name]
    return dumped


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "y", "on"}
    return bool(value)


def sglang_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template variables SGLang passes (``normalize_reasoning_inputs`` + ``reasoning_effort``)."""
    raw = body.get("chat_template_kwargs")
    if raw is not None and not isinstance(raw, Mapping):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    ctk = dict(raw or {})
    effort = body.get("reasoning_effort")
    thinking = None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping):
        nested = reasoning.get("effort", reasoning.get("reasoning_effort"))
        if nested is not None:
            effort = nested
        enabled = reasoning.get("enabled")
        if enabled is None:
            enabled = reasoning.get("enable", False)
        if _truthy(enabled):
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    if thinking is not None:
        ctk.setdefault("thinking", thinking)
        ctk.setdefault("enable_thinking", thinking)
    popped = ctk.pop("reasoning_effort", None)
    if popped is not None:
        effort = popped
    kwargs: dict[str, Any] = {}
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    kwargs.update((k, v) for k, v in ctk.items() if k not in _RESERVED_TEMPLATE_KWARGS)
    return kwargs


def sglang_render_input(body: Mapping[str, Any]) -> RenderInput:
    """What SGLang hands its chat template for a chat-completions body."""
    if body.get("continue_final_message"):
        # SGLang appends the final assistant text to the rendered prompt itself; not reproduced.
        raise RequestError(
            "continue_final_message is not supported by polar-mitm's SGLang rendering",
            param="continue_final_message",
        )
    return RenderInput(
        messages=sglang_messages(body.get("messages")),
        tools=sglang_tools(body.get("tools"), sglang_tool_choice(body)),
        kwargs=sglang_template_kwargs(body),
    )


def render_input(body: Mapping[str, Any], flavor: str = "vllm") -> RenderInput:
    """The template input ``flavor``'s server builds from a chat-completions body."""
    if flavor == "sglang":
        return sglang_render_input(body)
    if flavor == "vllm":
        return vllm_render_input(body)
    raise ValueError(f"unknown template flavor {flavor!r} (known: {', '.join(FLAVORS)})")


def history_message(flavor: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant reply as the next request would carry it, normalized for ``flavor``: the
    fallback renders it after the prompt to recover the text the model wrote."""
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    raw = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
    if reasoning:
        raw["reasoning" if flavor == "vllm" else "reasoning_content"] = reasoning
    if flavor == "sglang":
        return sglang_messages([raw], final_assistant_to_user=False)[0]
    return normalize_messages([raw])[0]
