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

The request's settings (tools, tool config, generation config, schemas) are read in
`gemini_config`; what every dialect shares is in `base`, `blocks`, `convert`, `assemble`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from ..core.sse import dumps
from . import compaction
from .assemble import ToolCallParts, reply_to_chunks
from .base import Dialect, DialectError, HarnessRequest, LocalContext, load_json_object
from .blocks import BlockStream
from .convert import (
    ChatBuilder,
    arguments_json,
    content_of,
    image_part,
    safe_id,
    seal,
    text_part,
    unseal,
)
from .gemini_config import function_tools, generation, get_field, repeated, tool_choice
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
_IGNORED = ("safetySettings", "labels", "serviceTier")
_PART_KINDS = (
    "text", "functionCall", "functionResponse", "inlineData", "fileData", "executableCode",
    "codeExecutionResult",
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
        if counting and isinstance(get_field(data, "generateContentRequest"), dict):
            data = get_field(data, "generateContentRequest")
        notes: list[str] = []
        builder = ChatBuilder()
        system = _system_text(get_field(data, "systemInstruction"))
        if system:
            builder.system(system)
        contents = repeated(get_field(data, "contents"), "contents")
        if not contents:
            raise DialectError("'contents' is required: a non-empty list of Content")
        _History(builder, notes).add_all(contents)
        chat: dict[str, Any] = {"messages": builder.result()}
        tools = function_tools(get_field(data, "tools"))
        if tools:
            chat["tools"] = tools
        choice = tool_choice(get_field(data, "toolConfig"), notes)
        if choice is not None and tools:
            chat["tool_choice"] = choice
        if get_field(data, "cachedContent"):
            raise DialectError(
                "'cachedContent' is not supported: polar-mitm keeps no cached contents; send "
                "the whole conversation in 'contents'"
            )
        for key in _IGNORED:
            if get_field(data, key) is not None:
                notes.append(f"ignored {key}")
        config = get_field(data, "generationConfig")
        if config is not None and not isinstance(config, dict):
            raise DialectError("'generationConfig' must be an object")
        show_thoughts = generation(config or {}, chat, notes, counting)
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


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, dict):
        raise DialectError(f"{where} must be a Content object")
    parts = repeated(content.get("parts"), f"{where}.parts")
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise DialectError(f"{where}.parts[{j}] must be an object")
    return parts


def _kind(part: dict[str, Any], where: str) -> str:
    for kind in _PART_KINDS:
        if get_field(part, kind) is not None:
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
            signed = unseal(get_field(part, "thoughtSignature"))
            if signed:
                sealed.append(signed)
            kind = _kind(part, at)
            if kind == "text":
                (thoughts if part.get("thought") else texts).append(_text_of(part, at))
            elif kind == "functionCall":
                call = get_field(part, "functionCall")
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
                call_id, output = self._response(get_field(part, "functionResponse"), at)
                self.builder.tool_result(call_id, output)
            elif kind == "text":
                if part.get("thought"):
                    self.notes.append(f"skipped {at}: a thought in a user turn")
                    continue
                content.append(text_part(_text_of(part, at)))
            elif kind == "inlineData":
                content.append(image_part(_image_url(get_field(part, "inlineData"), at)))
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
        mime, payload = get_field(data, "mimeType"), data.get("data")
        if isinstance(mime, str) and mime.startswith("image/") and isinstance(payload, str):
            return f"data:{mime};base64,{payload}"
    raise DialectError(f"{where}: only inlineData images (image/* with base64 data) are supported")


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
    parts = repeated(content.get("parts"), "parts")
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
