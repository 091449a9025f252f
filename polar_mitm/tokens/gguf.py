"""A GGUF file's metadata and the tokenizer it describes, without torch.

A GGUF carries its own tokenizer (vocabulary, merges, special ids, chat template) as metadata. The
documented way to get it is ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, but in
transformers 5 that path imports torch (its GGUF reader and, for the ``llama`` architecture, the
legacy loader that also needs the ``gguf`` package), and torch on Python 3.12 from PyPI is a 5 GB
CUDA build. The proxy and the reference server only need the tokenizer, so this module reads the
metadata itself (the GGUF v2/v3 key-value section, a few dozen lines of ``struct``) and hands it to
the same transformers builders ``from_pretrained`` uses (``convert_gguf_tokenizer``), giving the
same tokenizer. tests/e2e/loopback/test_realmodel.py checks it token for token against
llama.cpp's own tokenizer, and examples/trainer_checks/train_check.py against ``AutoTokenizer.from_pretrained(..., gguf_file=...)``
where torch is installed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# scalar value types: u8 i8 u16 i16 u32 i32 f32 bool (7) u64 i64 f64; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """A file that is not a GGUF this reader understands; the message names the file."""


@dataclass(frozen=True)
class GgufInfo:
    """What the server and the tokenizer need from a GGUF's metadata."""

    path: Path
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if value is not None else None

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def file_type(self) -> int | None:
        """``general.file_type`` (llama.cpp's ``llama_ftype``: 0 = all F32, 3 = mostly Q4_1, ...)."""
        value = self.metadata.get("general.file_type")
        return int(value) if value is not None else None


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GgufError(f"{self.path}: truncated GGUF metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GgufError(f"{self.path}: truncated GGUF string")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                size = struct.calcsize(fmt)
                end = self.pos + size * count
                if end > len(self.buf):
                    raise GgufError(f"{self.path}: truncated GGUF array")
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos = end
                return values
            return [self.value(item_kind) for _ in range(count)]
        raise GgufError(f"{self.path}: unknown GGUF value type {kind}")


def read_gguf(path: str | Path) -> GgufInfo:
    """The key-value metadata of a GGUF file (tensors are not read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, path)
            if buf[:4] != _MAGIC:
                raise GgufError(f"{path} is not a GGUF file (no GGUF magic)")
            cur.pos = 4
            version = cur.unpack("<I")
            if version not in _VERSIONS:
                raise GgufError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            cur.unpack("<Q")  # tensor count
            n_kv = cur.unpack("<Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.unpack("<I"))
    except OSError as e:
        raise GgufError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # mmap of an empty file
        if isinstance(e, GgufError):
            raise
        raise GgufError(f"{path} is not a GGUF file ({e})") from None
    if "general.architecture" not in metadata:
        raise GgufError(f"{path}: no general.architecture in the GGUF metadata")
    return GgufInfo(path, metadata)


def load_gguf_tokenizer(path: str | Path, info: GgufInfo | None = None) -> Any:
    """The tokenizer a GGUF describes, as a transformers fast tokenizer (chat template included).

    Mirrors transformers' ``get_gguf_tokenizer`` + ``convert_gguf_tokenizer`` (what
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` runs) with this module's reader.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # transformers < 5 keeps them in integrations.ggml
        raise GgufError(
            f"this transformers has no GGUF tokenizer builders (need transformers >= 5): {e}"
        ) from None
    info = info or read_gguf(path)
    md = info.metadata
    grouped = {
        group: {
            name: md[f"tokenizer.{key}"] for key, name in keys.items() if f"tokenizer.{key}" in md
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise GgufError(f"{info.path}: the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece files
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(info.architecture, tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise GgufError(f"{info.path}: cannot build its tokenizer: {e}") from None
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    if info.context_length:
        tokenizer.model_max_length = info.context_length
    return tokenizer
