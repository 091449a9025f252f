"""Sampled ids to text as vLLM's completions endpoint writes it (``polar_token_in=generate``).

vLLM's ``/inference/v1/generate`` with ``detokenize: false`` returns ids only; the text its
``/v1/completions`` would have sent is rebuilt here, step for step as vLLM 0.32's
``FastIncrementalDetokenizer`` (``vllm/v1/engine/detokenizer.py``) builds it:

* a ``tokenizers`` ``DecodeStream`` seeded with the prompt's last ids (so a first token's leading
  space decodes as it does there; vLLM seeds it with the whole prompt, whose first step then
  decodes all of it — 40 ms at 100k tokens — where the last few give the same text, as vLLM's own
  derender endpoint notes), one ``step`` per id;
* ``skip_special_tokens`` (default true) and ``spaces_between_special_tokens`` (default true) as
  the request sent them; with both false, consecutive added tokens join without the space;
* a generation that stopped on a stop token (EOS or ``stop_token_ids``: finish ``stop``) leaves
  that token out of the text unless ``include_stop_str_in_output``.

Stop strings need the server's detokenizer (vLLM refuses them with ``detokenize: false``): such a
call goes to ``/v1/completions`` instead (`call/exchange.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .tokenizer import PolicyTokenizer

# The prompt's last ids that seed the decoder: a few tokens of context is all a decoder reads.
SEED_IDS = 16


def vllm_text(
    tok: PolicyTokenizer,
    prompt_ids: Sequence[int],
    ids: Sequence[int],
    sampling: dict[str, Any],
    finish_reason: str | None,
) -> str:
    """The ``text`` vLLM's completions endpoint gives for sampled `ids` after `prompt_ids`."""
    skip = sampling.get("skip_special_tokens", True) is not False
    spaces = skip or sampling.get("spaces_between_special_tokens", True) is not False
    if finish_reason == "stop" and ids and not sampling.get("include_stop_str_in_output"):
        ids = ids[:-1]
    backend = getattr(tok.impl, "backend_tokenizer", None) if tok.kind == "hf" else None
    if backend is None:  # no Rust tokenizer (tiktoken): its plain decoding
        return tok.decode(ids)
    with tok.lock:
        stream = _Stream(backend, prompt_ids[-SEED_IDS:], skip)
        added = None
        if not spaces:
            added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        out: list[str] = []
        last_added = False
        for token_id in ids:
            piece = stream.step(token_id)
            if added is not None:
                content = added.get(token_id)
                if content is not None and last_added:
                    piece = content
                last_added = content is not None
            if piece:
                out.append(piece)
    return "".join(out)


_INVALID_PREFIX = "Invalid prefix encountered"


class _Stream:
    """vLLM's `_protected_step`: a DecodeStream that restarts (unseeded) on the "invalid
    prefix" error some tokenizers' non-monotonic output raises, and skips an id it overflows on."""

    def __init__(self, backend: Any, prompt_ids: Sequence[int], skip: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend, self.skip, self.make = backend, skip, DecodeStream
        self.stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip)

    def step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):
            return None
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self.stream = self.make(skip_special_tokens=self.skip)
            return self.stream.step(self.backend, token_id)
