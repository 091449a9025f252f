"""Output parsers: what a model family's raw generated text means as a chat-completions message.

Exact-prefix mode (`trajectory/exact_prefix.py`) sends the policy server token ids on its token-in endpoint,
which answers with raw text, not with the reasoning / content / tool-call split of its chat
endpoint. The proxy then does that split itself, the way the server's own parsers would, so the
harness gets the same reply either way. One module per model family, each exposing a `Family`;
`FAMILIES` maps the `polar_output_parser` option to it, so adding a family is one new module.
"""

from __future__ import annotations

from .base import Family, StreamingParser

__all__ = ["FAMILIES", "Family", "StreamingParser", "family"]


def _families() -> dict[str, Family]:
    from . import qwen3

    return {f.name: f for f in qwen3.FAMILIES}


FAMILIES: dict[str, Family] = _families()


def family(name: str) -> Family:
    """The family named by `polar_output_parser`; ValueError naming the known ones otherwise."""
    found = FAMILIES.get(name.strip().lower())
    if found is None:
        raise ValueError(f"unknown output parser {name!r} (known: {', '.join(FAMILIES)})")
    return found
