"""The policy tokenizer a proxy used, recorded with its shards, so `polar-mitm show DIR` decodes
with it without being told (``--tokenizer`` still overrides).

A small sidecar, ``<polar_output>/_polar_tokenizer.json``, written when the proxy starts with
``polar_tokenizer`` set: ``{"spec": ..., "kind": ..., "proxy_id": ...}``. The spec is
what ``polar_tokenizer`` named, with a local path made absolute (a proxy started in another
directory still points at the same files); a tokenizer spec is a path or an encoding name, never
a credential. Proxies sharing one output overwrite the file with their own (a farm runs one
policy). Output written before this file existed has none: `show` falls back as before.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any

from .store.files import replace_text
from .store.shards import resolve_output

log = logging.getLogger(__name__)
FILE = "_polar_tokenizer.json"
_PREFIXES = ("gguf:", "tiktoken:")


def portable(spec: str) -> str:
    """``spec`` with a local path made absolute; encoding names (``tiktoken:o200k_base``) as is."""
    prefix = next((p for p in _PREFIXES if spec.startswith(p)), "")
    rest = spec[len(prefix) :]
    if os.path.exists(rest):
        return prefix + os.path.abspath(rest)
    return spec


def write(output: str, spec: str, kind: str, proxy_id: str | None = None) -> None:
    """Put the sidecar under ``output`` (local or remote), replacing an older one whole."""
    where = resolve_output(output)
    data = {"spec": portable(spec), "kind": kind, "proxy_id": proxy_id}
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    if where.local:
        os.makedirs(where.root, exist_ok=True)
        path = os.path.join(where.root, FILE)
        # a name per process: proxies sharing an output may write it at once
        replace_text(path, text, tmp=f"{path}.{os.getpid()}.tmp", durable=False)
        return
    with where.fs.open_output_stream(posixpath.join(where.root, FILE)) as f:
        f.write(text.encode())


def read(output: str) -> dict[str, Any] | None:
    """The sidecar under ``output``, or None when there is none (or it is unreadable)."""
    try:
        where = resolve_output(output)
        join = os.path.join if where.local else posixpath.join
        with where.fs.open_input_stream(join(where.root, FILE)) as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("spec"), str) else None


class TokenizerRecordAddon:
    """Writes the sidecar once the store is running (after `StoreAddon.running`)."""

    def __init__(self, tokenizer: Any, store: Any) -> None:
        self.tokenizer = tokenizer  # TokenizerAddon
        self.store = store  # StoreAddon

    def running(self) -> None:
        from mitmproxy import ctx  # here: the CLI reads the sidecar without importing mitmproxy

        tok, store = self.tokenizer.tokenizer, self.store.store
        spec = ctx.options.polar_tokenizer
        if tok is None or store is None or not spec:
            return
        try:
            write(ctx.options.polar_output, spec, tok.kind, store.proxy_id)
        except (OSError, ValueError) as e:  # the capture goes on; `show` needs --tokenizer
            log.warning("polar-mitm: cannot record the tokenizer in %s: %s", FILE, e)
