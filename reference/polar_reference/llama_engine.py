"""A real policy for the reference server: a GGUF model run by llama.cpp, sampled token by token.

The engine evaluates the prompt ids it is given (the server renders them with the GGUF's own chat
template and tokenizer, so no text reaches llama.cpp), then each :meth:`Generation.step` reads the
logits of the last position, samples one token and returns it with its logprob; the next step first
feeds that token back. Nothing is sampled ahead: a stream's chunk for token ``i`` is written before
token ``i + 1`` exists.

Which distribution the logprob is from: ``log_softmax`` of the model's raw logits, in float64, rounded
to float32 (vLLM's default ``logprobs_mode=raw_logprobs``: before temperature, top-k or top-p). At
``temperature=1`` with no top-k/top-p — the only setting a GRPO importance ratio is meaningful for —
that is exactly the distribution the token was drawn from. Other settings sample from the processed
distribution and still report the raw logprob, as vLLM does.

One llama.cpp context holds one sequence, so generations run one at a time (the server queues them);
each prompt is evaluated from scratch (no prefix reuse), so a request with a ``seed`` is reproducible
whatever ran before it.

Precision: llama.cpp multiplies quantized weights (Q4_1 here) with activations quantized to 8 bits
(ggml's ``q8_1`` dot products), while a trainer that loads the GGUF with transformers dequantizes the
weights to float32 and computes in float32. :func:`dequantized_gguf` writes the same weights as an
all-F32 GGUF (llama.cpp's own ``llama_model_quantize`` with ``LLAMA_FTYPE_ALL_F32``: a dequantization,
no new rounding) so the engine can run the trainer's arithmetic; docs/realmodel.md has the measured
difference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polar_mitm.tokens.gguf import GgufInfo, read_gguf

log = logging.getLogger(__name__)

#: llama.cpp's LLAMA_FTYPE_ALL_F32
_FTYPE_ALL_F32 = 0


class EngineError(RuntimeError):
    """The model cannot be loaded or run; the message says what to install or fix."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise EngineError(
            "the real-model mode needs llama-cpp-python: ./scripts/test.sh installs it "
            "(built once from source into ~/.cache/polar-mitm/wheels), or pip install -e '.[realmodel]' "
            f"({e})"
        ) from None
    return llama_cpp


def default_cache_dir() -> Path:
    """Where derived model files go: ``$POLAR_CACHE_DIR``, else ``~/.cache/polar-mitm``."""
    return Path(os.environ.get("POLAR_CACHE_DIR") or Path.home() / ".cache" / "polar-mitm")


def dequantized_gguf(source: Path, cache_dir: Path | None = None) -> Path:
    """An all-F32 copy of ``source`` (written once, then reused): the same weights, dequantized.

    The file name carries a hash of the source's path, size and mtime, so a changed source gets a
    new copy; the copy is written to a temp name and renamed, so a crash leaves no half file.
    """
    source = Path(source).resolve()
    cache_dir = Path(cache_dir or default_cache_dir())
    st = source.stat()
    tag = hashlib.sha256(f"{source}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / f"{source.stem}.{tag}.f32.gguf"
    if target.exists():
        return target
    info = read_gguf(source)
    if info.file_type == _FTYPE_ALL_F32:
        return source
    llama_cpp = _llama_cpp()
    from llama_cpp._utils import suppress_stdout_stderr

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPE_ALL_F32
    params.allow_requantize = True  # the input is quantized: dequantize it
    params.pure = True  # every tensor F32, embeddings and output included
    params.output_tensor_type = 0  # GGML_TYPE_F32
    params.token_embedding_type = 0
    params.nthread = 1
    log.info("writing a dequantized (F32) copy of %s to %s", source, target)
    with suppress_stdout_stderr(disable=False):
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(tmp).encode(), ctypes.byref(params)
        )
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise EngineError(f"llama.cpp could not dequantize {source} (llama_model_quantize: {rc})")
    os.replace(tmp, target)
    return target


@dataclass(frozen=True)
class SamplingParams:
    """The request's sampling knobs (vLLM's names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None

    @property
    def plain(self) -> bool:
        """Temperature 1, no truncation: the logprob is the sampling distribution's."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0


@dataclass(frozen=True)
class Step:
    token_id: int
    logprob: float  # raw log_softmax of the logits, rounded to float32
    eog: bool  # an end-of-generation token (EOS, <|im_end|>, ...)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    return logits - (top + np.log(np.exp(logits - top).sum()))


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Draw one token id from ``logits`` (float64) under ``params``."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits / params.temperature if params.temperature != 1.0 else logits
    candidates: np.ndarray | None = None
    if 0 < params.top_k < z.size:
        candidates = np.argpartition(z, -params.top_k)[-params.top_k :]
    if params.top_p < 1.0:
        pool = candidates if candidates is not None else np.arange(z.size)
        order = pool[np.argsort(z[pool])[::-1]]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        candidates = order[:keep]
    if candidates is not None:
        zc = z[candidates]
        p = np.exp(zc - zc.max())
        cdf = np.cumsum(p)
        return int(candidates[np.searchsorted(cdf, rng.random() * cdf[-1], side="right")])
    p = np.exp(z - z.max())
    cdf = np.cumsum(p)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, z.size - 1)


class LlamaEngine:
    """One GGUF model in one llama.cpp context; :meth:`generate` starts a :class:`Generation`."""

    def __init__(
        self,
        gguf: str | Path,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        seed: int | None = None,
        dequantize: bool = False,
        cache_dir: Path | None = None,
    ) -> None:
        llama_cpp = _llama_cpp()
        self.source = Path(gguf)
        self.info: GgufInfo = read_gguf(self.source)
        self.model_path = dequantized_gguf(self.source, cache_dir) if dequantize else self.source
        self.dequantized = self.model_path != self.source
        trained = self.info.context_length or 2048
        self.n_ctx = min(n_ctx or trained, trained)
        # half the cores, as llama.cpp does: its threads spin while they wait, so using every core
        # of a shared machine makes decoding several times slower, not faster
        threads = threads or max(1, (os.cpu_count() or 2) // 2)
        try:
            self.llm = llama_cpp.Llama(
                str(self.model_path),
                n_ctx=self.n_ctx,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                logits_all=False,
                verbose=False,
            )
        except (ValueError, RuntimeError) as e:
            raise EngineError(f"llama.cpp cannot load {self.model_path}: {e}") from None
        self._vocab = self.llm._model.vocab
        self._is_eog = llama_cpp.llama_vocab_is_eog
        self.n_vocab = self.llm.n_vocab()
        self.eos_token_id = self.llm.token_eos()
        self._rng = np.random.default_rng(seed)
        self._busy = False
        # held while llama.cpp runs: a step still running in a worker thread after its request was
        # cancelled must finish before the next generation resets the context
        self._lock = threading.Lock()

    def is_eog(self, token_id: int) -> bool:
        return bool(self._is_eog(self._vocab, token_id))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Evaluate the prompt and return the generation (blocking: call it from a worker thread)."""
        if self._busy:
            raise EngineError("one generation at a time: the previous one is still open")
        if not prompt_ids:
            raise EngineError("empty prompt")
        if len(prompt_ids) >= self.n_ctx:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens does not fit n_ctx={self.n_ctx}")
        rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        with self._lock:
            self._busy = True
            try:
                self.llm.reset()
                self.llm.eval(list(prompt_ids))
            except BaseException:
                self._busy = False
                raise
        return Generation(self, len(prompt_ids), params, rng)

    def _release(self) -> None:
        self._busy = False

    def last_logits(self) -> np.ndarray:
        """The logits after the last evaluated token, as float64."""
        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)


class Generation:
    """One sequence being sampled: :meth:`step` per token, :meth:`close` when done (always)."""

    def __init__(
        self, engine: LlamaEngine, n_prompt: int, params: SamplingParams, rng: np.random.Generator
    ) -> None:
        self.engine = engine
        self.params = params
        self.n_past = n_prompt
        self._rng = rng
        self._pending: int | None = None
        self.logits: np.ndarray | None = None  # what the last step sampled from (float64)
        self.closed = False

    @property
    def room(self) -> int:
        """Tokens that still fit the context."""
        return self.engine.n_ctx - self.n_past - (self._pending is not None)

    def step(self) -> Step:
        """Feed the previous token (if any), then sample the next one."""
        if self.closed:
            raise EngineError("generation is closed")
        engine = self.engine
        with engine._lock:
            if self._pending is not None:
                engine.llm.eval([self._pending])
                self.n_past += 1
                self._pending = None
            if self.n_past >= engine.n_ctx:
                raise EngineError("context is full")
            self.logits = logits = engine.last_logits()
        token = sample_token(logits, self.params, self._rng)
        logprob = float(np.float32(_log_softmax(logits)[token]))
        self._pending = token
        return Step(token, logprob, engine.is_eog(token))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine._release()
