"""The policy tokenizer: a local Hugging Face tokenizer dir, `tiktoken:<encoding or file>`, or
`gguf:<model.gguf>` (the tokenizer and chat template a GGUF model file carries).

Loaded once at start-up (`polar_tokenizer`); a spec that cannot be loaded is a start-up error
naming the option, never a proxy that silently skips its checks.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


@dataclass(slots=True)
class PolicyTokenizer:
    spec: str
    kind: str  # "hf" | "tiktoken"
    impl: Any
    # HF fast tokenizers must not be driven from two threads at once ("Already borrowed"):
    # everyone who uses `impl` off the event loop holds this.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        if self.kind == "hf":
            return list(self.impl.encode(text, add_special_tokens=False))
        return self.impl.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)

    @property
    def has_chat_template(self) -> bool:
        return self.kind == "hf" and bool(getattr(self.impl, "chat_template", None))


def load_tokenizer(spec: str) -> PolicyTokenizer:
    if spec.startswith("tiktoken:"):
        return PolicyTokenizer(spec, "tiktoken", _load_tiktoken(spec[len("tiktoken:") :]))
    if spec.startswith("gguf:"):
        return PolicyTokenizer(spec, "hf", _load_gguf(spec[len("gguf:") :]))
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise TokenizerError(
            f"{spec!r} is not a directory (want a Hugging Face tokenizer dir or tiktoken:NAME)"
        )
    try:
        from transformers import AutoTokenizer

        return PolicyTokenizer(spec, "hf", AutoTokenizer.from_pretrained(str(path)))
    except Exception as e:  # transformers raises many types for a bad dir
        raise TokenizerError(f"cannot load a tokenizer from {spec!r}: {e}") from None


def _load_gguf(path: str) -> Any:
    from .gguf import GgufError, load_gguf_tokenizer

    if not os.path.isfile(path):
        raise TokenizerError(f"gguf: {path!r} is not a file (want gguf:/path/to/model.gguf)")
    try:
        return load_gguf_tokenizer(path)
    except GgufError as e:
        raise TokenizerError(str(e)) from None


def _load_tiktoken(name: str) -> Any:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    if not name:
        raise TokenizerError("tiktoken: needs an encoding name or a .tiktoken file")
    if os.path.isfile(name):
        try:
            ranks = load_tiktoken_bpe(name)
        except Exception as e:
            raise TokenizerError(f"cannot read tiktoken file {name!r}: {e}") from None
        return tiktoken.Encoding(
            name=Path(name).stem,
            pat_str=_QWEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={},
        )
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise TokenizerError(f"cannot load tiktoken encoding {name!r}: {e}") from None


# The pre-tokenizer pattern of Qwen's tiktoken files (qwen.tiktoken); GPT-4-like.
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
