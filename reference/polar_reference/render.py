"""Server-faithful prompt rendering and scripted-turn tokenization with a Hugging Face tokenizer.

The reference server is only useful if its ``prompt_token_ids`` are the ones the real server would
compute for the same request. The request normalization that decides this (content parts, tool-call
arguments, prior reasoning, tools) lives in :mod:`polar_mitm.tokens.conversation`, shared with the proxy's
no-ids fallback; its names are re-exported here.

A scripted turn's output ids are the real tokenization of the assistant turn as the chat template
renders it: the conversation plus the scripted message is rendered without a generation prompt, the
text after the generation-prompt rendering is what the model "wrote", and it is cut right after the
end-of-turn token, so the ids end with ``<|im_end|>`` (vLLM's ``token_ids`` include the EOS the model
sampled; its text does not).

When the full rendering does not start with the prompt rendering (Qwen3 with
``enable_thinking: false`` and a scripted ``reasoning``: the prompt already closed the think block),
the turn is rendered again without its reasoning; if that still does not line up, the text after the
longest common prefix is used and ``Completion.fallback`` says so. Both are logged.

Results are cached (LRU keyed by a hash of the request), so a benchmark can drive the server fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polar_mitm.tokens.conversation import (
    RenderInput,
    RequestError,
    normalize_messages,
    normalize_tools,
    template_kwargs,
)

from .scenario import Turn, assistant_message

__all__ = [
    "Completion",
    "Prompt",
    "RenderInput",
    "Renderer",
    "RequestError",
    "normalize_messages",
    "normalize_tools",
    "template_kwargs",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Completion:
    """What the model "samples" for a scripted turn.

    ``pieces[i]`` is the text token ``i`` adds to the detokenized output (special tokens skipped,
    ``""`` while a multi-byte character is incomplete), so ``"".join(pieces)`` is vLLM's output text.
    ``token_strs[i]`` is the token's own decoded string, as vLLM reports it in ``logprobs.content``.
    """

    ids: tuple[int, ...]
    pieces: tuple[str, ...]
    token_strs: tuple[str, ...]
    fallback: bool = False


_PROMPT_TEXTS = 64  # conversations whose latest prompt text `decode_prompt` keeps


class _LRU:
    """A small thread-safe LRU: rendering runs in worker threads."""

    def __init__(self, size: int):
        self._size = size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = make()
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def _turn_key(turn: Turn) -> str:
    return json.dumps(
        [turn.reasoning, turn.content, [(c.name, c.arguments) for c in turn.tool_calls]],
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )


class Renderer:
    """Renders prompts and scripted completions with one tokenizer; safe to call from threads."""

    def __init__(
        self, tokenizer_dir: str | Path | None = None, cache_size: int = 2048, *, tokenizer=None
    ):
        """``tokenizer``: an already loaded tokenizer (e.g. a GGUF's own); ``tokenizer_dir`` then
        only names where it came from."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            if tokenizer_dir is None:
                from polar_mitm.assets import qwen3_tokenizer_dir

                tokenizer_dir = qwen3_tokenizer_dir()
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.tokenizer_dir = Path(tokenizer_dir or ".")
        self.tokenizer = tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer in {self.tokenizer_dir} has no chat template")
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer in {self.tokenizer_dir} has no eos token")
        self.eos_token_id: int = eos
        vocab = self.tokenizer.get_vocab()
        self.think_start_id: int | None = vocab.get("<think>")
        self.think_end_id: int | None = vocab.get("</think>")
        self.turn_start_id: int | None = vocab.get("<|im_start|>")
        self.max_model_len: int = _max_model_len(self.tokenizer)
        self._prompts = _LRU(cache_size)
        self._completions = _LRU(cache_size)
        self._token_strs: dict[int, str] = {}
        self._max_token_chars: int | None = None
        # decode_prompt's earlier prompts: digest of their ids through a special token -> text
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        specials = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        self._special_ids = np.array(sorted(specials), dtype=np.int32)
        # Fast tokenizers are not safe to drive from several threads at once (transformers may
        # reconfigure truncation/padding on the shared Rust object: "Already borrowed").
        self._lock = threading.RLock()

    # -- prompts -----------------------------------------------------------------------------

    def _apply(
        self, inp: RenderInput, messages: list[dict[str, Any]], *, generation: bool, tokenize: bool
    ):
        try:
            with self._lock:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=inp.tools or None,
                    add_generation_prompt=generation,
                    continue_final_message=inp.continue_final_message and not generation,
                    tokenize=tokenize,
                    **inp.kwargs,
                )
        except Exception as e:  # jinja TemplateError and friends: vLLM answers 400
            raise RequestError(f"chat template failed: {e}") from e

    def prompt(self, inp: RenderInput) -> Prompt:
        """``apply_chat_template(..., add_generation_prompt=True, tokenize=True)["input_ids"]``."""

        def make() -> Prompt:
            text = self._apply(
                inp, inp.messages, generation=inp.add_generation_prompt, tokenize=False
            )
            encoded = self._apply(
                inp, inp.messages, generation=inp.add_generation_prompt, tokenize=True
            )
            ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
            return Prompt(ids=tuple(int(i) for i in ids), text=text)

        return self._prompts.get_or_make(inp.key, make)

    def min_prompt_tokens(self, inp: RenderInput) -> int:
        """A lower bound on the prompt's token count without tokenizing: the characters of the
        messages' text over the longest token's length. Tokenizing a 20 MB prompt takes half a
        minute; this bound turns it away at once when it is far beyond the context length."""
        chars = 0
        for message in inp.messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
        if chars < self.max_model_len:  # cannot exceed: at least one character per token
            return 0
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self.tokenizer.get_vocab())
        return chars // self._max_token_chars

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(list(ids))

    def decode_prompt(self, ids: Sequence[int]) -> str:
        """``decode(ids)`` for a token-in prompt, reusing the text of an earlier prompt this one
        extends: an agent session re-sends its whole conversation on every call, and decoding
        80k ids is tens of milliseconds a real server (which never decodes a prompt of ids)
        does not spend. What is kept of a prompt ends on its last special token, where the text
        ends whole (no character split between two ids).

        Kept texts are found by the digest of the ids before each special token of this prompt,
        taken in one pass of one hash: sessions that share their first thousands of ids (one
        system prompt, a GRPO group's task) each find their own prompt, however many there are
        (keyed by the first ids alone, eight such sessions evicted each other's entries and every
        late call decoded its whole prompt: 33-80 ms at 57k ids under the long load (polar_bench/long.py))."""
        int32 = ids if isinstance(ids, array) and ids.itemsize == 4 else array("i", ids)
        data = memoryview(int32).cast("B")  # no copy of a token-in body's array
        bounds = np.flatnonzero(np.isin(np.frombuffer(data, dtype=np.int32), self._special_ids))
        digest = hashlib.blake2b(digest_size=16)
        ends: list[tuple[int, bytes]] = []  # through each special token: (ids, digest)
        done = 0
        for bound in bounds.tolist():
            digest.update(data[4 * done : 4 * (bound + 1)])
            done = bound + 1
            ends.append((done, digest.digest()))
        text, start = "", 0
        with self._lock:
            for end, key in reversed(ends):  # the longest kept text first
                known = self._texts.get(key)
                if known is not None:
                    text, start = known, end
                    self._texts.move_to_end(key)
                    break
        if ends and ends[-1][0] > start:
            end, key = ends[-1]
            text += self.decode(ids[start:end])
            start = end
            with self._lock:
                self._texts[key] = text
                while len(self._texts) > _PROMPT_TEXTS:
                    self._texts.popitem(last=False)
        return text + self.decode(ids[start:])

    def token_names(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` (``/tokenize``'s ``token_strs``)."""
        with self._lock:
            return list(self.tokenizer.convert_ids_to_tokens(list(ids)))

    # -- scripted completions ----------------------------------------------------------------

    def completion(self, inp: RenderInput, turn: Turn) -> Completion:
        """The token ids the model "samples" for ``turn`` after this prompt (cached)."""
        return self._completions.get_or_make(
            (inp.key, _turn_key(turn)), lambda: self._make_completion(inp, turn)
        )

    def _make_completion(self, inp: RenderInput, turn: Turn) -> Completion:
        prompt_text = self.prompt(inp).text
        fallback = False
        text = None
        attempts = [True, False] if turn.reasoning is not None else [True]
        for with_reasoning in attempts:
            full = self._apply(
                inp,
                [*inp.messages, assistant_message(turn, with_reasoning)],
                generation=False,
                tokenize=False,
            )
            if full.startswith(prompt_text):
                text = full[len(prompt_text) :]
                if not with_reasoning:
                    log.warning(
                        "scripted reasoning dropped: the prompt already closed the think block"
                    )
                break
        if text is None:
            common = _common_prefix_len(prompt_text, full)
            text = full[common:]
            fallback = True
            log.warning(
                "chat template does not render the scripted turn as a continuation of the prompt; "
                "using the rendered text after the common prefix (%d chars)",
                common,
            )
        ids = self.encode_text(text, add_special_tokens=False)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id) + 1]
        else:
            ids.append(self.eos_token_id)
        return Completion(
            ids=tuple(ids),
            pieces=tuple(self._pieces(ids)),
            token_strs=tuple(self.token_str(i) for i in ids),
            fallback=fallback,
        )

    def _pieces(self, ids: Sequence[int]) -> list[str]:
        """Per-token detokenized deltas, as vLLM's incremental detokenizer produces them."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # pragma: no cover - old tokenizers
            DecodeStream = None  # noqa: N806
        if backend is not None and DecodeStream is not None:
            stream = DecodeStream(skip_special_tokens=True)
            with self._lock:
                return [stream.step(backend, i) or "" for i in ids]
        pieces, previous = [], ""
        for n in range(1, len(ids) + 1):
            with self._lock:
                text = self.tokenizer.decode(list(ids[:n]), skip_special_tokens=True)
            if text.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(text[len(previous) :])
            previous = text
        return pieces

    def token_str(self, token_id: int) -> str:
        """A token's decoded string (vLLM's ``Logprob.decoded_token``), cached per id."""
        value = self._token_strs.get(token_id)
        if value is None:
            with self._lock:
                value = self.tokenizer.decode([token_id])
                self._token_strs[token_id] = value
        return value

    def reasoning_open_at_end(self, prompt_ids: Sequence[int]) -> bool | None:
        """Whether the generation prompt itself left a think block open (``True``), closed
        (``False``: e.g. Qwen3 with ``enable_thinking: false``) or never opened it (``None``).

        Only the last turn is inspected: vLLM versions that scanned the whole prompt mistook a
        previous assistant turn's ``</think>`` for "reasoning already ended" (vllm PR #32490).
        """
        for token in reversed(prompt_ids):
            if token == self.think_end_id:
                return False
            if token == self.think_start_id:
                return True
            if token == self.turn_start_id:
                return None
        return None

    def clear_caches(self) -> None:
        self._prompts.clear()
        self._completions.clear()


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _max_model_len(tokenizer: Any) -> int:
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**8:
        return value
    return 40960
