"""Token usage: the policy server's chat-completions `usage`, in each harness dialect's shape.

The server's counts are the truth (they are what the record's `count_check` compares with the
sampled ids); a dialect only renames them. Fields a server leaves out count as 0, as the real
APIs report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Counts:
    prompt: int = 0
    completion: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache
    reasoning: int = 0  # completion tokens spent thinking (when the server says)

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def counts(usage: dict[str, Any] | None, prompt_tokens: int | None = None) -> Counts:
    """Read a chat `usage` object; `prompt_tokens` fills in when the server sent none yet."""
    if not usage or not isinstance(usage, dict):
        return Counts(prompt=prompt_tokens or 0)
    prompt_details = _dict(usage.get("prompt_tokens_details"))
    completion_details = _dict(usage.get("completion_tokens_details"))
    return Counts(
        prompt=_int(usage.get("prompt_tokens"), prompt_tokens or 0),
        completion=_int(usage.get("completion_tokens")),
        cached=_int(prompt_details.get("cached_tokens")),
        reasoning=_int(completion_details.get("reasoning_tokens")),
    )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def responses_usage(c: Counts) -> dict[str, Any]:
    """OpenAI Responses `usage` (Codex reads `input_tokens_details` / `output_tokens_details`)."""
    return {
        "input_tokens": c.prompt,
        "input_tokens_details": {"cached_tokens": c.cached, "cache_write_tokens": 0},
        "output_tokens": c.completion,
        "output_tokens_details": {"reasoning_tokens": c.reasoning},
        "total_tokens": c.total,
    }


def anthropic_usage(c: Counts) -> dict[str, Any]:
    """Anthropic Messages `usage`: prompt tokens read from the cache are reported apart, as
    Anthropic does, so `input_tokens + cache_read_input_tokens` is the whole prompt."""
    return {
        "input_tokens": c.prompt - c.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": c.cached,
        "output_tokens": c.completion,
    }


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
