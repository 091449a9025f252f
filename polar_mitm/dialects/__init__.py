"""Harness wire APIs. Each module holds one `Dialect`; `detect` picks the one a request speaks."""

from __future__ import annotations

from .base import Dialect, DialectError, HarnessRequest, StreamTranslator
from .openai_chat import OpenAIChat

DIALECTS: tuple[Dialect, ...] = (OpenAIChat(),)


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


__all__ = ["DIALECTS", "Dialect", "DialectError", "HarnessRequest", "StreamTranslator", "by_name", "detect"]
