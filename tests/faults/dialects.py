"""How the fault suite speaks each harness dialect: one row per entry of `polar_mitm.dialects.DIALECTS`.

A row knows what a valid request looks like and how to read that dialect's replies, stream events
and error shape, written from the public API's documentation, not from `polar_mitm.dialects` (a bug
there must not hide in the test too). Every fault test and the fuzz run once per row, so a new
dialect joins the suite by adding a row to `ROWS`; a dialect without one fails `test_every_dialect_
has_a_row` and every test parametrized on it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.dialects import DIALECTS


@dataclass(frozen=True)
class ErrorShape:
    type: str
    message: str


@dataclass
class StreamResult:
    """A harness's event stream, checked to be well formed for its dialect."""

    events: list[Any] = field(default_factory=list)  # decoded `data:` payloads, in order
    text: str = ""  # the visible text (content deltas)
    reply_id: str | None = None
    done: bool = False  # ended the dialect's normal way
    error: ErrorShape | None = None  # ended with the dialect's error event


class DialectRow(ABC):
    name: str
    host: str
    path: str
    # The body field where a harness puts free-form metadata (the proxy must scrub keys in it).
    metadata_field = "metadata"
    # The query parameter an API key may travel in (None: headers only).
    key_param: str | None = None
    # test_client_hangs_up_mid_stream: the upstream stalls after this many chunks (the role chunk,
    # then one token each), and the harness hangs up on its event of this number, the last one
    # those chunks make in this dialect.
    stall_after_chunks = 5
    events_before_stall = 5
    # Other URLs of the dialect's endpoint, each sent a valid body: the HTTP status it must get,
    # with a reply or an error in the dialect's shape.
    odd_urls: tuple[tuple[str, int], ...] = ()

    @property
    def url(self) -> str:
        return f"https://{self.host}{self.path}"

    def url_for(self, stream: bool) -> str:
        """Where a (streaming) call goes: one URL for both, unless the dialect says otherwise."""
        return self.url

    @abstractmethod
    def body(self, text: str, stream: bool, **extra: Any) -> dict[str, Any]:
        """A valid request whose first (only) user message is `text`."""

    @abstractmethod
    def headers(self, api_key: str | None) -> dict[str, str]:
        """The headers this harness sends, with its API key where it puts it."""

    @abstractmethod
    def error(self, payload: Any) -> ErrorShape:
        """Read an error body; AssertionError if it is not this dialect's error shape."""

    @abstractmethod
    def reply(self, payload: Any) -> tuple[str, str | None]:
        """(visible text, reply id) of a non-streaming reply; AssertionError if malformed."""

    # The payload that ends a stream without being JSON (OpenAI chat's `[DONE]`), if any.
    done_payload: str | None = None

    def stream(self, payloads: list[str]) -> StreamResult:
        """Check and read a stream given its `data:` payloads (AssertionError if malformed)."""
        result, text = StreamResult(), []
        for data in payloads:
            assert not result.done and result.error is None, f"event after the end: {data!r}"
            if data == self.done_payload:
                result.done = True
                continue
            obj = json.loads(data)
            result.events.append(obj)
            text.append(self.event(obj, data, result))
        if self.done_payload is None:  # the dialect names its reply in an event of its own
            assert result.reply_id is not None or result.error is not None, payloads[:3]
        result.text = "".join(text)
        return result

    @abstractmethod
    def event(self, obj: Any, data: str, result: StreamResult) -> str:
        """Check one decoded stream event, note its end, error or reply id in `result`, and
        return its visible text ("" for none); AssertionError if malformed."""

    def kind(self, kind: str, status: int = 200) -> str:
        """This dialect's error type for one of the OpenAI-named kinds the suite expects, in an
        answer of HTTP `status` (200: an error event ending a stream)."""
        return kind


class OpenAIChatRow(DialectRow):
    """OpenAI chat completions: `{"error": {message, type, param, code}}`; a stream of
    `chat.completion.chunk` objects ending in `data: [DONE]`, or in an error object."""

    name = "openai_chat"
    host = "api.openai.com"
    path = "/v1/chat/completions"

    def body(self, text: str, stream: bool, **extra: Any) -> dict[str, Any]:
        return {
            "model": "gpt-4.1-mini",
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
            **extra,
        }

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def error(self, payload: Any) -> ErrorShape:
        assert isinstance(payload, dict) and set(payload) == {"error"}, payload
        err = payload["error"]
        assert isinstance(err, dict) and {"message", "type"} <= set(err), payload
        assert isinstance(err["message"], str) and err["message"], payload
        assert isinstance(err["type"], str) and err["type"], payload
        return ErrorShape(err["type"], err["message"])

    def reply(self, payload: Any) -> tuple[str, str | None]:
        assert isinstance(payload, dict) and payload.get("object") == "chat.completion", payload
        assert isinstance(payload.get("id"), str), payload
        choices = payload["choices"]
        assert isinstance(choices, list) and choices, payload
        choice = choices[0]
        message = choice["message"]
        assert isinstance(message, dict) and choice["finish_reason"], payload
        assert "token_ids" not in choice and "prompt_token_ids" not in payload, payload
        content = message.get("content")
        return content if isinstance(content, str) else "", payload["id"]

    done_payload = "[DONE]"

    def event(self, obj: Any, data: str, result: StreamResult) -> str:
        assert isinstance(obj, dict), data
        if obj.get("error"):  # what the SDKs raise on (`"error": null` is no error)
            result.error = self.error(obj)
            return ""
        assert obj.get("object") == "chat.completion.chunk", data
        assert "prompt_token_ids" not in obj, data
        if result.reply_id is None:
            result.reply_id = obj.get("id")
        assert obj.get("id") == result.reply_id, f"chunk {len(result.events)} changed id: {data!r}"
        text = []
        for choice in obj.get("choices") or ():
            assert "token_ids" not in choice, data
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                text.append(content)
        return "".join(text)


class OpenAIResponsesRow(DialectRow):
    """OpenAI Responses (Codex): the chat dialect's error body; a stream of typed events from
    `response.created` to `response.completed` / `response.incomplete`, or `response.failed`
    with `response.error {code, message}`."""

    name = "openai_responses"
    host = "api.openai.com"
    path = "/v1/responses"

    def body(self, text: str, stream: bool, **extra: Any) -> dict[str, Any]:
        message = {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": text}]}  # fmt: skip
        return {"model": "gpt-5-codex", "input": [message], "stream": stream, "store": False,
                **extra}  # fmt: skip

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def error(self, payload: Any) -> ErrorShape:
        return OpenAIChatRow.error(self, payload)

    def _text(self, output: Any) -> str:
        assert isinstance(output, list), output
        text = []
        for item in output:
            assert isinstance(item, dict) and isinstance(item.get("type"), str), item
            if item["type"] == "message":
                for part in item["content"]:
                    if part.get("type") == "output_text":
                        assert isinstance(part["text"], str), part
                        text.append(part["text"])
        return "".join(text)

    def reply(self, payload: Any) -> tuple[str, str | None]:
        assert isinstance(payload, dict) and payload.get("object") == "response", payload
        assert payload["status"] in ("completed", "incomplete"), payload
        assert isinstance(payload.get("id"), str), payload
        return self._text(payload["output"]), payload["id"]

    def event(self, obj: Any, data: str, result: StreamResult) -> str:
        assert isinstance(obj, dict) and isinstance(obj.get("type"), str), data
        kind = obj["type"]
        if kind == "error":
            result.error = ErrorShape(str(obj.get("code")), obj["message"])
        elif (
            kind.startswith("response.")
            and "response" in obj
            and kind != "response.output_item.added"
        ):
            response = obj["response"]
            if result.reply_id is None:
                result.reply_id = response["id"]
            assert response["id"] == result.reply_id, data
            if kind in ("response.completed", "response.incomplete"):
                result.done = True
            elif kind == "response.failed":
                error = response["error"]
                result.error = ErrorShape(error["code"], error["message"])
        elif kind == "response.output_text.delta":
            assert isinstance(obj["delta"], str), data
            return obj["delta"]
        return ""


class AnthropicMessagesRow(DialectRow):
    """Anthropic Messages (Claude Code): `{"type": "error", "error": {type, message}}`; a stream
    from `message_start` to `message_stop`, or an `error` event."""

    name = "anthropic_messages"
    host = "api.anthropic.com"
    path = "/v1/messages"

    def body(self, text: str, stream: bool, **extra: Any) -> dict[str, Any]:
        return {"model": "claude-sonnet-4-5", "max_tokens": 4096, "stream": stream,
                "messages": [{"role": "user", "content": text}], **extra}  # fmt: skip

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": "2023-06-01"}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def error(self, payload: Any) -> ErrorShape:
        assert isinstance(payload, dict) and payload.get("type") == "error", payload
        err = payload["error"]
        assert isinstance(err, dict) and isinstance(err.get("type"), str), payload
        assert isinstance(err.get("message"), str) and err["message"], payload
        return ErrorShape(err["type"], err["message"])

    def kind(self, kind: str, status: int = 200) -> str:
        return {"server_error": "api_error"}.get(kind, kind)

    def reply(self, payload: Any) -> tuple[str, str | None]:
        assert isinstance(payload, dict) and payload.get("type") == "message", payload
        assert payload["role"] == "assistant" and payload["stop_reason"], payload
        assert isinstance(payload.get("id"), str), payload
        text = [b["text"] for b in payload["content"] if b.get("type") == "text"]
        assert all(isinstance(t, str) for t in text), payload
        return "".join(text), payload["id"]

    def event(self, obj: Any, data: str, result: StreamResult) -> str:
        assert isinstance(obj, dict) and isinstance(obj.get("type"), str), data
        kind = obj["type"]
        if kind == "error":
            result.error = self.error(obj)
        elif kind == "message_start":
            assert result.reply_id is None, data
            result.reply_id = obj["message"]["id"]
        elif kind == "message_stop":
            result.done = True
        elif kind == "content_block_delta" and obj["delta"].get("type") == "text_delta":
            assert isinstance(obj["delta"]["text"], str), data
            return obj["delta"]["text"]
        return ""


class GoogleGeminiRow(DialectRow):
    """Google's Gemini API (Gemini CLI): `POST /v1beta/models/{model}:generateContent`, or
    `:streamGenerateContent?alt=sse`; the key in `x-goog-api-key` (or `?key=`). Errors are
    `{"error": {code, message, status}}` with google.rpc status names, and a failure mid-stream is
    that object as the last event. A stream has no opening or closing event: `GenerateContentResponse`
    objects, the last with `finishReason` (Google frames them with `\\r\\n`)."""

    name = "google_gemini"
    host = "generativelanguage.googleapis.com"
    path = "/v1beta/models/gemini-2.5-pro:generateContent"
    metadata_field = "labels"
    key_param = "key"
    # Qwen3 thinks first: the first chunks are thoughts Google does not show (includeThoughts is
    # off), so only the later ones make events.
    stall_after_chunks = 8
    events_before_stall = 3
    odd_urls = (
        (f"https://{host}/v1beta/models/gemini-2.5-pro:streamGenerateContent", 400),  # no alt=sse
        (f"https://{host}/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=proto", 400),
        (f"https://{host}/v1/models/gemini-2.5-flash:countTokens", 200),
        (f"https://{host}/v1beta/models/x:generateContent?alt=json", 200),
    )
    # google.rpc.Code names, by HTTP status (https://cloud.google.com/apis/design/errors)
    _STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "INVALID_ARGUMENT",
               429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 502: "UNAVAILABLE",
               503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}  # fmt: skip
    _KIND = {"invalid_request_error": "INVALID_ARGUMENT", "rate_limit_error": "RESOURCE_EXHAUSTED",
             "server_error": "INTERNAL"}  # fmt: skip

    def url_for(self, stream: bool) -> str:
        if not stream:
            return self.url
        return self.url.replace(":generateContent", ":streamGenerateContent?alt=sse")

    def body(self, text: str, stream: bool, **extra: Any) -> dict[str, Any]:
        return {"contents": [{"role": "user", "parts": [{"text": text}]}],
                "generationConfig": {"temperature": 0.7}, **extra}  # fmt: skip

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"x-goog-api-key": api_key} if api_key else {}

    def error(self, payload: Any) -> ErrorShape:
        assert isinstance(payload, dict) and set(payload) == {"error"}, payload
        err = payload["error"]
        assert isinstance(err, dict) and isinstance(err.get("code"), int), payload
        assert isinstance(err.get("message"), str) and err["message"], payload
        assert isinstance(err.get("status"), str) and err["status"].isupper(), payload
        return ErrorShape(err["status"], err["message"])

    def kind(self, kind: str, status: int = 200) -> str:
        return self._STATUS[status] if status != 200 else self._KIND[kind]

    def _candidate(self, payload: Any) -> tuple[dict[str, Any], str]:
        """The one candidate of a `GenerateContentResponse`, and its visible text."""
        assert isinstance(payload, dict) and isinstance(payload.get("responseId"), str), payload
        candidates = payload["candidates"]
        assert isinstance(candidates, list) and len(candidates) == 1, payload
        candidate = candidates[0]
        assert isinstance(candidate, dict), payload
        # the engine's extras stripped (keys only: the model's text may say "token_ids")
        usage = payload.get("usageMetadata") or {}
        assert not any("token_ids" in k for k in (*payload, *candidate, *usage)), payload
        parts = candidate["content"]["parts"]
        assert candidate["content"]["role"] == "model" and isinstance(parts, list), payload
        text = [p["text"] for p in parts if "text" in p and not p.get("thought")]
        assert all(isinstance(t, str) for t in text), payload
        return candidate, "".join(text)

    def reply(self, payload: Any) -> tuple[str, str | None]:
        candidate, text = self._candidate(payload)
        assert candidate.get("finishReason"), payload
        assert isinstance(payload.get("usageMetadata"), Mapping), payload
        return text, payload["responseId"]

    def event(self, obj: Any, data: str, result: StreamResult) -> str:
        if isinstance(obj, dict) and "error" in obj:
            result.error = self.error(obj)
            return ""
        candidate, piece = self._candidate(obj)
        if result.reply_id is None:
            result.reply_id = obj["responseId"]
        assert obj["responseId"] == result.reply_id, data
        if candidate.get("finishReason"):
            assert isinstance(obj.get("usageMetadata"), Mapping), data
            result.done = True
        return piece


#: The suite's rows, by dialect name. A new dialect adds its row here.
ROWS: dict[str, DialectRow] = {
    row.name: row
    for row in (OpenAIChatRow(), OpenAIResponsesRow(), AnthropicMessagesRow(), GoogleGeminiRow())
}


class MissingRow(DialectRow):
    """Stands in for a dialect the suite has no row for: every use fails, saying what to add."""

    host = path = ""

    def __init__(self, name: str) -> None:
        self.name = name

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"dialect {self.name!r} has no row in tests/faults/dialects.py ROWS: add one "
            "(a valid body, its headers, how to read its replies, streams and errors)"
        )

    body = headers = error = reply = stream = event = _fail


def dialect_rows() -> list[DialectRow]:
    """One row per registered dialect, in registry order (parametrize with `ids=str`)."""
    return [ROWS.get(d.name) or MissingRow(d.name) for d in DIALECTS]


def row_id(row: DialectRow) -> str:
    return row.name
