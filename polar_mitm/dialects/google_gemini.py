"""Google's Gemini API (`POST .../models/{model}:generateContent`, `:streamGenerateContent`,
`:countTokens`): Gemini CLI and the `@google/genai` / `google-genai` SDKs.

The policy servers return token ids only on chat completions, so a Gemini request becomes a
chat-completions request upstream and the chat stream becomes `GenerateContentResponse` events
again, as they arrive (`?alt=sse`: one `data: {...}` event per response).

Request (`parse`), shaped by what Gemini CLI 0.61 really sends (docs/dialects.md):
* `systemInstruction` (a Content, or a string) is the system message; `contents` are the turns:
  role `user` (or `function`, the old name for tool results) and `model`;
* in a `model` turn, `text` parts are its content (joined as they are: parts of one text),
  `thought` parts its reasoning, `functionCall` parts its tool calls; a `thoughtSignature` that
  polar-mitm sealed (`convert.seal`) is the reasoning of a turn whose thought parts the client
  dropped (Gemini CLI keeps signatures and drops thoughts), so the template re-renders it;
* in a `user` turn, `functionResponse` parts become tool messages, in place (matched to their
  call by `id`, else by name in order), `text` and `inlineData` images the user's content;
  `fileData`, code execution and other part kinds are refused with a 400 that names them;
* `tools[].functionDeclarations` are function tools (`parametersJsonSchema` as it is,
  `parameters` — Google's OpenAPI subset — with its upper-case types lowered); Google's own
  tools (`googleSearch`, `codeExecution`, `urlContext`, ...) cannot run behind this proxy and
  are refused; `toolConfig.functionCallingConfig` becomes `tool_choice`;
* `generationConfig`: `maxOutputTokens`, `temperature`, `topP`, `topK`, `stopSequences`,
  `presencePenalty`, `frequencyPenalty`, `seed`, JSON output (`responseMimeType`,
  `responseJsonSchema` / `responseSchema` -> `response_format`), `thinkingConfig` (->
  `chat_template_kwargs`); `candidateCount` must be 1.
Fields are read in both spellings proto JSON allows (`systemInstruction` / `system_instruction`).
What was left out is listed in `HarnessRequest.notes` (the record's `translation_notes`).

`countTokens` is answered locally with the policy tokenizer (`local_reply`). Each request gets a
`purpose`: `count_tokens`; for a tool-less Gemini CLI call (its router, next-speaker and other
helper calls carry no tools; its agent loop always does) `compaction` when it asks for a
`<state_snapshot>` (its history compression), else `side`; else `main`.

Reply: each event is a whole `GenerateContentResponse` (one candidate) with the parts that
chunk added: `{"text", "thought": true}` while the policy thinks (only with
`thinkingConfig.includeThoughts`), `{"text"}` deltas, one `{"functionCall": {id, name, args}}`
per tool call once its arguments are complete; the first part after the thinking carries it
sealed as `thoughtSignature`. The last event has `finishReason` and `usageMetadata`. An upstream
failure mid-stream ends the stream with `data: {"error": {code, message, status}}`, Google's
error object, as an error before the stream is the HTTP status with that body.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from ..call.sse import dumps
from . import compaction
from .assemble import ToolCallParts, reply_to_chunks
from .base import Dialect, DialectError, HarnessRequest, LocalContext, is_a, load_json_object
from .blocks import BlockStream
from .convert import (
    ChatBuilder,
    arguments_json,
    content_of,
    function_tool,
    image_part,
    number,
    positive_int,
    safe_id,
    seal,
    text_part,
    unseal,
)
from .usage import counts

# `/v1beta/models/gemini-2.5-pro:streamGenerateContent` (any API version, Vertex's long form too).
_ENDPOINT = re.compile(r"/models/([^/:]+):(generateContent|streamGenerateContent|countTokens)$")
# Google's canonical error status names (google.rpc.Code) by HTTP status.
# fmt: off
_STATUS = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
    500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_KIND_CODES = {"invalid_request_error": 400, "rate_limit_error": 429}
_FINISH = {
    "stop": "STOP",
    "tool_calls": "STOP",  # Google ends a function-call turn with STOP
    "function_call": "STOP",
    "length": "MAX_TOKENS",
    "content_filter": "SAFETY",
}
# Google's tools: each runs on Google's servers, which nothing behind polar-mitm replaces.
_SERVER_TOOLS = (
    "googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext", "computerUse",
    "fileSearch", "googleMaps", "retrieval", "enterpriseWebSearch",
)
_IGNORED = ("safetySettings", "labels", "serviceTier")
_PART_KINDS = (
    "text", "functionCall", "functionResponse", "inlineData", "fileData", "executableCode",
    "codeExecutionResult",
)
# generationConfig -> chat (`top_k`: vLLM's and SGLang's sampling extension), and the ranges.
_SAMPLING = {
    "maxOutputTokens": "max_tokens", "temperature": "temperature", "topP": "top_p",
    "topK": "top_k", "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty", "seed": "seed",
}
_RANGES = {
    "temperature": (0.0, 2.0), "topP": (0.0, 1.0), "presencePenalty": (-2.0, 2.0),
    "frequencyPenalty": (-2.0, 2.0),
}
# The generationConfig fields read (each in its two spellings); others are noted as ignored.
_CONFIG_KEYS = (
    *_SAMPLING, "candidateCount", "stopSequences", "responseModalities", "responseMimeType",
    "responseJsonSchema", "responseSchema", "responseLogprobs", "logprobs", "thinkingConfig",
)
# fmt: on
# Gemini CLI puts this in its first user turn (its session context) and nowhere else.
GEMINI_CLI_MARKER = "This is the Gemini CLI."
SNAPSHOT = "<state_snapshot>"  # what Gemini CLI's history compression asks the model to write


class GoogleGemini(Dialect):
    name = "google_gemini"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and _ENDPOINT.search(path) is not None

    def refuse_query(self, path: str, query: Mapping[str, str]) -> str | None:
        alt = query.get("alt")
        if path.endswith(":streamGenerateContent") and alt != "sse":
            return (
                "streamGenerateContent is served as server-sent events only: add ?alt=sse "
                "(every Google SDK does)"
            )
        if alt not in (None, "sse", "json"):
            return f"alt={alt!r} is not supported (json, or sse to stream)"
        return None

    def parse(self, body: bytes, path: str) -> HarnessRequest:
        found = _ENDPOINT.search(path)
        if found is None:
            raise DialectError(f"{path} is not a Gemini generateContent endpoint", 404)
        model, action = found.groups()
        data = load_json_object(body)
        counting = action == "countTokens"
        if counting and isinstance(_get(data, "generateContentRequest"), dict):
            data = _get(data, "generateContentRequest")
        notes: list[str] = []
        builder = ChatBuilder()
        system = _system_text(_get(data, "systemInstruction"))
        if system:
            builder.system(system)
        contents = _listish(_get(data, "contents"), "contents")
        if not contents:
            raise DialectError("'contents' is required: a non-empty list of Content")
        _History(builder, notes).add_all(contents)
        chat: dict[str, Any] = {"messages": builder.result()}
        tools = _tools(_get(data, "tools"))
        if tools:
            chat["tools"] = tools
        choice = _tool_choice(_get(data, "toolConfig"), notes)
        if choice is not None and tools:
            chat["tool_choice"] = choice
        if _get(data, "cachedContent"):
            raise DialectError(
                "'cachedContent' is not supported: polar-mitm keeps no cached contents; send "
                "the whole conversation in 'contents'"
            )
        for key in _IGNORED:
            if _get(data, key) is not None:
                notes.append(f"ignored {key}")
        config = _get(data, "generationConfig")
        if config is not None and not isinstance(config, dict):
            raise DialectError("'generationConfig' must be an object")
        show_thoughts = _generation(config or {}, chat, notes, counting)
        return HarnessRequest(
            body=data,
            model=model,
            stream=action == "streamGenerateContent",
            chat=chat,
            purpose="count_tokens" if counting else _purpose(contents, bool(tools)),
            local=counting,
            notes=notes,
            extra={"show_thoughts": show_thoughts},
        )

    def reply(self, req: HarnessRequest, chat_reply: dict[str, Any]) -> dict[str, Any]:
        return _GeminiStream(req, live=False).run(reply_to_chunks(chat_reply))

    def stream(self, req: HarnessRequest) -> _GeminiStream:
        return _GeminiStream(req)

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return error_object(status, message, kind)

    def local_reply(self, req: HarnessRequest, local: LocalContext) -> dict[str, Any]:
        return {"totalTokens": local.prompt_tokens(req.chat)}


def error_object(status: int, message: str, kind: str = "") -> dict[str, Any]:
    """Google's error JSON: `{"error": {code, message, status}}` (the SDKs read `code`)."""
    code = status if 400 <= status < 600 else _KIND_CODES.get(kind, 500)
    fallback = "INVALID_ARGUMENT" if code < 500 else "INTERNAL"
    return {"error": {"code": code, "message": message, "status": _STATUS.get(code, fallback)}}


# -- reading the request ----------------------------------------------------------------------


@functools.cache
def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def _get(obj: dict[str, Any], name: str) -> Any:
    """A field by its proto JSON name, or the snake_case one Google's REST examples use."""
    value = obj.get(name)
    return value if value is not None else obj.get(_snake(name))


def _listish(value: Any, where: str) -> list[Any]:
    """A repeated field; Google also takes a single object for one element."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise DialectError(f"'{where}' must be a list")
    return value


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, dict):
        raise DialectError(f"{where} must be a Content object")
    parts = _listish(content.get("parts"), f"{where}.parts")
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise DialectError(f"{where}.parts[{j}] must be an object")
    return parts


def _kind(part: dict[str, Any], where: str) -> str:
    for kind in _PART_KINDS:
        if _get(part, kind) is not None:
            return kind
    raise DialectError(f"{where} has none of {', '.join(_PART_KINDS)}")


def _system_text(system: Any) -> str:
    if system is None or system == "":
        return ""
    if isinstance(system, str):
        return system
    texts = []
    for j, part in enumerate(_parts(system, "systemInstruction")):
        text = part.get("text")
        if not isinstance(text, str):
            raise DialectError(f"systemInstruction.parts[{j}] must be a text part")
        texts.append(text)
    return "\n".join(texts)


def _text_of(part: dict[str, Any], where: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise DialectError(f"{where}.text must be a string")
    return text


class _History:
    """`contents` -> chat messages, pairing each functionResponse with its functionCall."""

    def __init__(self, builder: ChatBuilder, notes: list[str]) -> None:
        self.builder = builder
        self.notes = notes
        self.pending: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
        self.calls = 0

    def add_all(self, contents: list[Any]) -> None:
        for i, content in enumerate(contents):
            where = f"contents[{i}]"
            parts = _parts(content, where)
            role = content.get("role") or "user"
            if role == "model":
                self._model(parts, where)
            elif role in ("user", "function"):
                self._user(parts, where)
            else:
                raise DialectError(f"{where}.role must be 'user' or 'model', not {role!r}")

    def _model(self, parts: list[dict[str, Any]], where: str) -> None:
        builder = self.builder
        texts: list[str] = []
        thoughts: list[str] = []
        sealed: list[str] = []
        self.pending = []
        for j, part in enumerate(parts):
            at = f"{where}.parts[{j}]"
            signed = unseal(_get(part, "thoughtSignature"))
            if signed:
                sealed.append(signed)
            kind = _kind(part, at)
            if kind == "text":
                (thoughts if part.get("thought") else texts).append(_text_of(part, at))
            elif kind == "functionCall":
                call = _get(part, "functionCall")
                name = call.get("name") if isinstance(call, dict) else None
                if not isinstance(name, str) or not name:
                    raise DialectError(f"{at}.functionCall needs a string 'name'")
                args = call.get("args")
                if args is not None and not isinstance(args, dict):
                    raise DialectError(f"{at}.functionCall.args must be an object")
                call_id = call.get("id") if isinstance(call.get("id"), str) else None
                call_id = call_id or self._new_id()
                self.pending.append((call_id, name))
                builder.tool_call(call_id, name, arguments_json(args or {}))
            else:
                raise DialectError(f"{at}: {kind} parts in a model turn are not supported")
        reasoning = "".join(thoughts) or "".join(sealed)
        if reasoning:
            builder.reasoning(reasoning)
        builder.assistant_text("".join(texts))
        builder.end_turn()

    def _user(self, parts: list[dict[str, Any]], where: str) -> None:
        content: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            at = f"{where}.parts[{j}]"
            kind = _kind(part, at)
            if kind == "functionResponse":
                if content:
                    self.builder.user(content_of(content))
                    content = []
                call_id, output = self._response(_get(part, "functionResponse"), at)
                self.builder.tool_result(call_id, output)
            elif kind == "text":
                if part.get("thought"):
                    self.notes.append(f"skipped {at}: a thought in a user turn")
                    continue
                content.append(text_part(_text_of(part, at)))
            elif kind == "inlineData":
                content.append(image_part(_image_url(_get(part, "inlineData"), at)))
            else:
                raise DialectError(f"{at}: {kind} parts are not supported by polar-mitm")
        if content or not parts:
            self.builder.user(content_of(content))

    def _response(self, response: Any, where: str) -> tuple[str, str]:
        if not isinstance(response, dict):
            raise DialectError(f"{where}.functionResponse must be an object")
        name = response.get("name")
        if not isinstance(name, str) or not name:
            raise DialectError(f"{where}.functionResponse needs a string 'name'")
        if response.get("parts"):
            raise DialectError(f"{where}.functionResponse.parts (multimodal) is not supported")
        given = response.get("id") if isinstance(response.get("id"), str) else None
        match = next(
            (c for c in self.pending if c[0] == given)
            if given
            else (c for c in self.pending if c[1] == name),
            None,
        )
        if match is not None:
            self.pending.remove(match)
        call_id = given or (match[0] if match is not None else self._new_id())
        return call_id, _response_text(response.get("response"))

    def _new_id(self) -> str:
        """Ids for calls the client sent without one: stable, so a longer history of the same
        conversation gets the same ones."""
        self.calls += 1
        return f"call_{self.calls}"


def _response_text(value: Any) -> str:
    """What the policy reads as the tool result: the `output` string of `{"output": ...}`
    (Gemini CLI's shape), else the response object as compact JSON."""
    if isinstance(value, dict) and list(value) == ["output"] and isinstance(value["output"], str):
        return value["output"]
    if value is None:
        return ""
    return dumps(value)


def _image_url(data: Any, where: str) -> str:
    if isinstance(data, dict):
        mime, payload = _get(data, "mimeType"), data.get("data")
        if isinstance(mime, str) and mime.startswith("image/") and isinstance(payload, str):
            return f"data:{mime};base64,{payload}"
    raise DialectError(f"{where}: only inlineData images (image/* with base64 data) are supported")


def _tools(raw: Any) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(_listish(raw, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise DialectError(f"{where} must be an object")
        for key in _SERVER_TOOLS:
            if _get(tool, key) is not None:
                raise DialectError(
                    f"{where}: Google tool {key!r} is not supported: nothing behind polar-mitm "
                    "can run it"
                )
        declarations = _listish(_get(tool, "functionDeclarations"), f"{where}.functionDeclarations")
        for j, decl in enumerate(declarations):
            tools.append(_declaration(decl, f"{where}.functionDeclarations[{j}]"))
    return tools


def _declaration(decl: Any, where: str) -> dict[str, Any]:
    if not isinstance(decl, dict):
        raise DialectError(f"{where} must be an object")
    name = decl.get("name")
    if not isinstance(name, str) or not name:
        raise DialectError(f"{where} needs a string 'name'")
    schema = _get(decl, "parametersJsonSchema")
    if schema is None and _get(decl, "parameters") is not None:
        schema = json_schema(_get(decl, "parameters"))
    if schema is not None and not isinstance(schema, dict):
        raise DialectError(f"{where}: the parameters must be an object")
    description = decl.get("description")
    return function_tool(name, description if isinstance(description, str) else None, schema)


def json_schema(schema: Any) -> Any:
    """Google's OpenAPI-subset Schema as JSON Schema: its enum-style upper-case `type` names
    (`OBJECT`, `STRING`, ...) lowered, in nested properties, items and anyOf too; every other
    keyword kept as it is."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: json_schema(s) for name, s in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


# Keywords whose value is a schema (or a list of them), and those that map names to schemas.
_SCHEMA_VALUES = frozenset(
    {"items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not"}
)
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})


def _tool_choice(config: Any, notes: list[str]) -> Any:
    if config is None:
        return None
    calling = _get(config, "functionCallingConfig") if isinstance(config, dict) else None
    if calling is None:
        return None
    if not isinstance(calling, dict):
        raise DialectError("'toolConfig.functionCallingConfig' must be an object")
    mode = str(calling.get("mode") or "AUTO").upper()
    allowed = _get(calling, "allowedFunctionNames") or []
    if mode in ("AUTO", "MODE_UNSPECIFIED"):
        return "auto"
    if mode == "NONE":
        return "none"
    if mode == "VALIDATED":
        notes.append("toolConfig mode VALIDATED sent as auto")
        return "auto"
    if mode == "ANY":
        if isinstance(allowed, list) and len(allowed) == 1 and isinstance(allowed[0], str):
            return {"type": "function", "function": {"name": allowed[0]}}
        if allowed:
            notes.append("toolConfig allowedFunctionNames not enforced (required: any tool)")
        return "required"
    raise DialectError(f"'toolConfig.functionCallingConfig.mode' {mode!r} is not supported")


def _generation(
    config: dict[str, Any], chat: dict[str, Any], notes: list[str], counting: bool
) -> bool:
    """generationConfig into the chat body; whether the client asked to see the thoughts."""
    known = {*_CONFIG_KEYS, *map(_snake, _CONFIG_KEYS)}
    notes.extend(f"ignored generationConfig.{key}" for key in config if key not in known)
    config = {k: v for k, v in ((key, _get(config, key)) for key in _CONFIG_KEYS) if v is not None}
    for key, target in _SAMPLING.items():
        if key in _RANGES:
            value = number(config, key, *_RANGES[key])
        elif key == "seed":
            value = config.get(key)
            if value is not None and not is_a(value, int):
                raise DialectError("'seed' must be an integer")
        else:
            value = positive_int(config, key)
        if value is not None and not (counting and key == "maxOutputTokens"):
            chat[target] = value
    if config.get("candidateCount") not in (None, 1):
        raise DialectError("polar-mitm captures one sample per call: 'candidateCount' must be 1")
    stops = config.get("stopSequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise DialectError("'stopSequences' must be a list of strings")
        chat["stop"] = stops
    modalities = config.get("responseModalities") or []
    if not isinstance(modalities, list) or any(str(m).upper() != "TEXT" for m in modalities):
        raise DialectError("'responseModalities' must be TEXT: the policy writes text only")
    fmt = _response_format(config)
    if fmt is not None:
        chat["response_format"] = fmt
    if config.get("responseLogprobs") or config.get("logprobs"):
        notes.append("responseLogprobs not returned (the record has the logprobs)")
    thinking = config.get("thinkingConfig") or {}
    if not isinstance(thinking, dict):
        raise DialectError("'thinkingConfig' must be an object")
    kwargs: dict[str, Any] = {}
    budget = _get(thinking, "thinkingBudget")
    level = _get(thinking, "thinkingLevel")
    if budget is not None:
        if not is_a(budget, int):
            raise DialectError("'thinkingConfig.thinkingBudget' must be an integer")
        kwargs["enable_thinking"] = budget != 0
    if isinstance(level, str) and level.upper() != "THINKING_LEVEL_UNSPECIFIED":
        kwargs["reasoning_effort"] = level.lower()
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return bool(_get(thinking, "includeThoughts"))


def _response_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """JSON output: `responseMimeType: application/json` with an optional schema."""
    mime = config.get("responseMimeType")
    schema = config.get("responseJsonSchema")
    if schema is None:
        schema = config.get("responseSchema")
    # Gemini CLI writes Google's upper-case type names in its responseJsonSchema too, which no
    # server's JSON-schema decoding takes; lowering them changes nothing in a valid schema.
    schema = json_schema(schema)
    if mime in (None, "text/plain") and schema is None:
        return None
    if mime not in (None, "application/json"):
        raise DialectError(f"'responseMimeType' {mime!r} is not supported (text/plain or JSON)")
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise DialectError("'responseJsonSchema' must be an object")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def _purpose(contents: list[Any], has_tools: bool) -> str:
    """`main`, or for a tool-less Gemini CLI call (its helper calls carry no tools, its agent
    loop always does) `compaction` (its history compression) or `side`."""
    if has_tools:
        return "main"
    first = _texts(contents[0]) if contents else ""
    if GEMINI_CLI_MARKER not in first:
        return "main"
    last_user = next(
        (_texts(c) for c in reversed(contents) if (c.get("role") or "user") == "user"), ""
    )
    return compaction.PURPOSE if SNAPSHOT in last_user else "side"


def _texts(content: dict[str, Any]) -> str:
    parts = _listish(content.get("parts"), "parts")
    return "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str))


# -- the reply --------------------------------------------------------------------------------


class _GeminiStream(BlockStream):
    """Chat chunks -> `GenerateContentResponse` events (and, at the end, the whole response)."""

    def __init__(self, req: HarnessRequest, live: bool = True) -> None:
        super().__init__()
        self.req = req
        self.live = live
        self.id = uuid.uuid4().hex[:24]
        self.show_thoughts = bool(req.extra.get("show_thoughts"))
        self.parts: list[dict[str, Any]] = []  # the whole reply, for `final`
        self.pieces: list[str] = []
        self.signature: str | None = None  # the sealed thinking, for the next part
        self.malformed = False
        self.finish_value = "STOP"
        self.usage_metadata: dict[str, Any] = {}

    def _response(self, candidate: dict[str, Any]) -> dict[str, Any]:
        return {
            "candidates": [{**candidate, "index": 0}],
            "modelVersion": self.req.model,
            "responseId": self.id,
        }

    def _send(self, parts: list[dict[str, Any]]) -> None:
        if self.live:
            response = self._response({"content": {"role": "model", "parts": parts}})
            self.emit(b"data: " + dumps(response).encode() + b"\r\n\r\n")

    def _signed(self, part: dict[str, Any]) -> dict[str, Any]:
        if self.signature is not None:
            part["thoughtSignature"], self.signature = self.signature, None
        return part

    # -- hooks ---------------------------------------------------------------------------------

    def on_start(self, first_chunk: dict[str, Any]) -> None:
        pass  # Gemini streams have no opening event

    def on_open_reasoning(self) -> None:
        self.pieces = []

    def on_reasoning(self, text: str) -> None:
        self.pieces.append(text)
        if self.show_thoughts:
            self._send([{"text": text, "thought": True}])

    def on_close_reasoning(self) -> None:
        thinking = "".join(self.pieces)
        self.signature = seal(thinking)
        if self.show_thoughts:
            self.parts.append({"text": thinking, "thought": True})

    def on_open_text(self) -> None:
        self.pieces = []

    def on_text(self, text: str, logprobs: Any) -> None:
        self.pieces.append(text)
        if self.live:
            self._send([self._signed({"text": text})])

    def on_close_text(self) -> None:
        self.parts.append(self._signed({"text": "".join(self.pieces)}))

    def on_open_tool(self, tool: ToolCallParts) -> None:
        tool.id = safe_id(tool.id, "call_")

    def on_tool_arguments(self, tool: ToolCallParts, delta: str) -> None:
        pass  # Google sends a function call whole, once its arguments are complete

    def on_close_tool(self, tool: ToolCallParts) -> None:
        try:
            args = json.loads(tool.arguments) if tool.arguments.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):  # what Google reports for a call it cannot parse
            self.malformed = True
            return
        part = self._signed({"functionCall": {"id": tool.id, "name": tool.name, "args": args}})
        self.parts.append(part)
        self._send([part])

    def on_end(self) -> None:
        if self.signature is not None:  # thinking alone: its signature on an empty text part
            part = self._signed({"text": ""})
            self.parts.append(part)
            self._send([part])
        finish = _FINISH.get(self.finish_reason or "stop", "OTHER")
        self.finish_value = "MALFORMED_FUNCTION_CALL" if self.malformed else finish
        c = counts(self.usage, self.prompt_tokens)
        usage = {
            "promptTokenCount": c.prompt,
            "candidatesTokenCount": c.completion - c.reasoning,
            "totalTokenCount": c.total,
        }
        if c.reasoning:
            usage["thoughtsTokenCount"] = c.reasoning
        if c.cached:
            usage["cachedContentTokenCount"] = c.cached
        self.usage_metadata = usage
        if self.live:
            last = self._response(
                {"content": {"role": "model", "parts": []}, "finishReason": self.finish_value}
            )
            last["usageMetadata"] = usage
            self.emit(b"data: " + dumps(last).encode() + b"\r\n\r\n")

    def on_fail(self, message: str, kind: str) -> None:
        self.emit(b"data: " + dumps(error_object(0, message, kind)).encode() + b"\r\n\r\n")

    def final(self) -> dict[str, Any]:
        response = self._response(
            {"content": {"role": "model", "parts": self.parts}, "finishReason": self.finish_value}
        )
        response["usageMetadata"] = self.usage_metadata
        return response
