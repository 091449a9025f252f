"""OpenAI chat completions (`POST .../chat/completions`): what Pi and most SDKs speak.

The policy server speaks the same API, so the request passes through almost unchanged; the work
is on the way back: the harness gets the reply it would have got from OpenAI, with its own model
name and without the token fields we asked the server for (`prompt_token_ids`, `token_ids`,
`logprobs` unless the harness asked, the usage chunk unless it asked).
"""

from __future__ import annotations

import uuid
from typing import Any

from ..core.sse import encode_json
from .base import (
    Dialect,
    DialectError,
    HarnessRequest,
    StreamTranslator,
    load_json_object,
    optional,
    require,
)

# Fields we set upstream ourselves; the harness's values are remembered, not forwarded.
_OWNED = ("model", "stream_options", "logprobs", "top_logprobs")


class OpenAIChat(Dialect):
    name = "openai_chat"

    def matches(self, method: str, path: str) -> bool:
        return method == "POST" and path.endswith("/chat/completions")

    def parse(self, body: bytes, path: str) -> HarnessRequest:
        data = load_json_object(body)
        messages = require(data, "messages", list, "a list of messages")
        if not messages:
            raise DialectError("'messages' must not be empty")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DialectError(f"messages[{i}] must be an object with a string 'role'")
        model = optional(data, "model", str, "a string") or ""
        stream = bool(optional(data, "stream", bool, "a boolean"))
        n = optional(data, "n", int, "an integer")
        if n not in (None, 1):
            raise DialectError("polar-mitm captures one sample per call: 'n' must be 1")
        logprobs = bool(optional(data, "logprobs", bool, "a boolean"))
        top = optional(data, "top_logprobs", int, "an integer between 0 and 20") or 0
        if not 0 <= top <= 20:
            raise DialectError("'top_logprobs' must be an integer between 0 and 20")
        options = optional(data, "stream_options", dict, "an object") or {}
        usage = bool(optional(options, "include_usage", bool, "a boolean"))
        for key in ("tools", "stop"):
            optional(data, key, (list, str) if key == "stop" else list, "a list")
        chat = {k: v for k, v in data.items() if k not in _OWNED}
        return HarnessRequest(
            body=data,
            model=model,
            stream=stream,
            chat=chat,
            wants_logprobs=logprobs,
            top_logprobs=top,
            wants_usage=usage,
        )

    def reply(self, req: HarnessRequest, chat_reply: dict[str, Any]) -> dict[str, Any]:
        chat_reply["model"] = req.model or chat_reply.get("model")
        chat_reply["object"] = "chat.completion"
        if not isinstance(chat_reply.get("id"), str):
            chat_reply["id"] = _new_id()
        if not req.wants_logprobs:
            _drop_logprobs(chat_reply)
        return chat_reply

    def stream(self, req: HarnessRequest) -> StreamTranslator:
        return _ChatStream(req)

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _ChatStream(StreamTranslator):
    __slots__ = ("model", "logprobs", "usage", "id")

    def __init__(self, req: HarnessRequest) -> None:
        self.model = req.model
        self.logprobs = req.wants_logprobs
        self.usage = req.wants_usage
        self.id: str | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if not chunk.get("choices") and chunk.get("usage") is None:
            return b""  # nothing for the harness: SGLang's sglext chunk once its ids are taken
        if not self.usage:
            if not chunk.get("choices") and chunk.get("usage") is not None:
                return b""  # the usage chunk we asked for; the harness did not
            chunk.pop("usage", None)
        if self.model:
            chunk["model"] = self.model
        # One id and the chunk type on every chunk, whatever the server sent: SDKs key on them.
        if self.id is None:
            upstream_id = chunk.get("id")
            self.id = upstream_id if isinstance(upstream_id, str) else _new_id()
        chunk["id"] = self.id
        chunk["object"] = "chat.completion.chunk"
        if not self.logprobs:
            _drop_logprobs(chunk)
        return encode_json(chunk)

    def finish(self) -> bytes:
        return b"data: [DONE]\n\n"

    def fail(self, message: str, kind: str = "server_error") -> bytes:
        # OpenAI ends a failed stream with an error object; the SDKs raise APIError on it.
        return encode_json(
            {"error": {"message": message, "type": kind, "param": None, "code": None}}
        )


def _new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _drop_logprobs(obj: dict[str, Any]) -> None:
    for choice in obj.get("choices") or ():
        if choice.get("logprobs") is not None:
            choice["logprobs"] = None
