"""Harness wire APIs. Each module holds one `Dialect`; `detect` picks the one a request speaks."""

from __future__ import annotations

from .anthropic_messages import AnthropicMessages
from .base import Dialect, DialectError, HarnessRequest, LocalContext, StreamTranslator
from .google_gemini import GoogleGemini
from .openai_chat import OpenAIChat
from .openai_responses import OpenAIResponses

DIALECTS: tuple[Dialect, ...] = (
    OpenAIChat(),
    OpenAIResponses(),
    AnthropicMessages(),
    GoogleGemini(),
)


def detect(method: str, path: str) -> Dialect | None:
    """The dialect whose LLM endpoint this is (`path` without its query string), or None."""
    for dialect in DIALECTS:
        if dialect.matches(method, path):
            return dialect
    return None


def by_name(name: str) -> Dialect:
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise KeyError(name)


__all__ = [
    "DIALECTS",
    "Dialect",
    "DialectError",
    "HarnessRequest",
    "LocalContext",
    "StreamTranslator",
    "by_name",
    "detect",
]
