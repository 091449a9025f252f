"""The small interface every harness wire API implements.

The internal lingua franca is the OpenAI chat-completions format the policy servers speak:
a dialect translates the harness's request into a chat-completions body (`parse`), and the
server's reply — already stripped of token fields by the upstream module — back into what the
harness expects (`reply` for one JSON body, `stream` for an event stream). Adding a harness API
is one new module with one `Dialect` subclass, registered in `dialects/__init__.py`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ..core import fastjson


class DialectError(Exception):
    """The harness sent something we cannot serve; answered in the dialect's error shape."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


@dataclass(slots=True)
class HarnessRequest:
    """A parsed harness request and the chat-completions body it becomes upstream."""

    body: dict[str, Any]
    model: str
    stream: bool
    chat: dict[str, Any]  # upstream body, before the upstream module adds its token fields
    wants_logprobs: bool = False
    top_logprobs: int = 0
    wants_usage: bool = False  # chat streams: the harness asked for the usage chunk
    purpose: str = "main"  # main | side | title | summary | count_tokens ... (CallRecord.purpose)
    local: bool = False  # answered by `Dialect.local_reply`, without an upstream call
    # What the translation left out or changed, one line each (CallRecord.translation_notes).
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # dialect-private state


class LocalContext(Protocol):
    """What `Dialect.local_reply` may use: the proxy's own resources, never the upstream."""

    def prompt_tokens(self, chat: dict[str, Any]) -> int:
        """How many tokens the policy's prompt for this chat body has."""
        ...


class StreamTranslator(ABC):
    """Turns cleaned upstream chat chunks into the harness's event stream, chunk by chunk.

    One translator serves one call: `Call` keeps it, so `fail` can end the stream it started
    (a Responses stream must fail under the id it was created with). `prompt_tokens` is set by
    `Call` once the upstream has told the prompt length (its token fields are taken out of the
    chunks before the translator sees them), for dialects that announce it up front.
    """

    content_type: ClassVar[str] = "text/event-stream"
    prompt_tokens: int | None = None

    @abstractmethod
    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """Bytes to send to the harness for one upstream chunk (b"" to send nothing yet)."""

    @abstractmethod
    def finish(self) -> bytes:
        """The upstream stream ended normally."""

    @abstractmethod
    def fail(self, message: str, kind: str = "server_error") -> bytes:
        """The upstream broke mid-stream: end the harness's stream with the dialect's error event."""


class Dialect(ABC):
    name: ClassVar[str]

    @abstractmethod
    def matches(self, method: str, path: str) -> bool:
        """Is this (method, path without query) one of this dialect's LLM endpoints?"""

    @abstractmethod
    def parse(self, body: bytes, path: str) -> HarnessRequest:
        """Validate the harness body; raise DialectError with a message a user can act on."""

    @abstractmethod
    def reply(self, req: HarnessRequest, chat_reply: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming reply body for the harness."""

    @abstractmethod
    def stream(self, req: HarnessRequest) -> StreamTranslator: ...

    @abstractmethod
    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        """The dialect's error JSON (what the real API returns, so SDKs raise the right error)."""

    def refuse_query(self, path: str, query: Mapping[str, str]) -> str | None:
        """Why this request's query string cannot be served (a 400), or None. Only Google's
        API puts a reply format there (`?alt=sse`)."""
        return None

    def local_reply(self, req: HarnessRequest, local: LocalContext) -> dict[str, Any]:
        """The reply to a request parsed with `local=True` (e.g. Anthropic's count_tokens)."""
        raise DialectError(f"{self.name} answers no requests locally", 500, "server_error")

    def error_bytes(self, status: int, message: str, kind: str) -> bytes:
        return json.dumps(self.error_body(status, message, kind)).encode()


def load_json_object(body: bytes) -> dict[str, Any]:
    """Shared first step of `parse`: the body must be a JSON object of valid Unicode text."""
    try:
        # Strict UTF-8 (RFC 8259), not json's own decoding: that one lets surrogates encoded as
        # bytes through ("surrogatepass"), and no store or tokenizer takes them.
        text = body.decode("utf-8")
        data, lone_surrogate = fastjson.decode(text)
    except RecursionError:
        raise DialectError("request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of 5000 digits
        raise DialectError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DialectError(f"request body must be a JSON object, not {type(data).__name__}")
    if lone_surrogate:
        raise DialectError(
            "request body holds a lone surrogate escape (e.g. \\ud800): not valid Unicode text"
        )
    return data


def require(data: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if value is None:
        raise DialectError(f"'{key}' is required ({what})")
    if not is_a(value, kind):
        raise DialectError(f"'{key}' must be {what}")
    return value


def optional(data: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if value is not None and not is_a(value, kind):
        raise DialectError(f"'{key}' must be {what}")
    return value


def is_a(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except that a JSON boolean is not a number."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)
