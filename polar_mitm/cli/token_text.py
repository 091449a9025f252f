"""Token ids -> the text each token stands for, for people (`polar-mitm show`, the HTML report).

Decoding a whole sequence gives the right text but says nothing about where each token starts;
decoding tokens one by one breaks characters whose UTF-8 bytes span two tokens (``✓`` is three
bytes, often two tokens). So each token is turned into its *bytes* and the bytes are fed to one
incremental UTF-8 decoder: a character is attributed to the token that completes it, and the
pieces always join to the decoded text.

- byte-level BPE (GPT-2, Qwen, Llama 3: a fast tokenizer whose decoder is ``ByteLevel``): the
  token string maps back to bytes through the standard byte<->unicode table;
- tiktoken: ``decode_single_token_bytes``;
- anything else (SentencePiece, ...): ``decode([id])``, with runs that decode to U+FFFD merged
  until they form whole characters.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from typing import Any

from ..tokens.tokenizer import PolicyTokenizer, TokenizerError, load_tokenizer


def _byte_level_table() -> dict[str, int]:
    """unicode char -> byte for byte-level BPE vocabularies: printable Latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def is_byte_level(impl: Any) -> bool:
    backend = getattr(impl, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def token_bytes(tok: PolicyTokenizer, ids: Sequence[int]) -> list[bytes] | None:
    """Each token's bytes, or None when the tokenizer gives no byte view (use `token_pieces`)."""
    if tok.kind == "tiktoken":
        return [tok.impl.decode_single_token_bytes(i) for i in ids]
    if not is_byte_level(tok.impl):
        return None
    out = []
    specials = set(getattr(tok.impl, "all_special_tokens", ()) or ())
    for piece in tok.impl.convert_ids_to_tokens(list(ids)):
        if piece is None:
            out.append(b"")
        elif piece in specials or any(ch not in _BYTE_LEVEL for ch in piece):
            out.append(piece.encode("utf-8"))  # added tokens (<|im_start|>) are their own text
        else:
            out.append(bytes(_BYTE_LEVEL[ch] for ch in piece))
    return out


def token_pieces(tok: PolicyTokenizer, ids: Sequence[int]) -> list[str]:
    """One string per token; ``"".join(pieces)`` is the text of ``ids``."""
    with tok.lock:
        raw = token_bytes(tok, ids)
        if raw is not None:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            pieces = [decoder.decode(b) for b in raw]
            if pieces:
                pieces[-1] += decoder.decode(b"", final=True)
            return pieces
        return _pieces_by_decode(tok, ids)


def _pieces_by_decode(tok: PolicyTokenizer, ids: Sequence[int]) -> list[str]:
    pieces: list[str] = []
    start = 0
    for i in range(len(ids)):
        text = tok.decode(list(ids[start : i + 1]))
        if text.endswith("\ufffd") and i + 1 < len(ids) and i - start < 8:
            pieces.append("")  # an incomplete character: the next token completes it
            continue
        pieces.append(text)
        start = i + 1
    return pieces


def resolve(spec: str | None, models: Sequence[str] = ()) -> tuple[PolicyTokenizer | None, str]:
    """The tokenizer to decode with, and where it came from (for a note to the user).

    ``spec`` (``--tokenizer`` / ``POLAR_TOKENIZER``) is loaded or raises `TokenizerError`. Without
    one, each served model name is tried as a Hugging Face id in the local cache only (vLLM's
    model names usually are one; nothing is downloaded). None when nothing loads.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found"
    if spec:
        return load_tokenizer(spec), spec
    for model in dict.fromkeys(m for m in models if m):
        try:
            from transformers import AutoTokenizer

            impl = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except Exception:  # not cached / not a tokenizer: try the next, else show ids
            continue
        return PolicyTokenizer(model, "hf", impl), f"{model} (local Hugging Face cache)"
    return None, ""


__all__ = ["TokenizerError", "is_byte_level", "resolve", "token_bytes", "token_pieces"]
