"""Real-model mode of the reference server: a GGUF model sampled by llama.cpp, in vLLM's wire format.

Same endpoints, request validation, error shapes and reply shapes as the scripted vLLM kind
(``vllm_wire.py``); what differs is where the tokens come from. The prompt is rendered with the
GGUF's own chat template and tokenizer (:func:`polar_mitm.tokens.gguf.load_gguf_tokenizer`), the ids go to
:class:`~polar_reference.llama_engine.LlamaEngine`, and a stream's chunk for each token is
built and written as soon as that token is sampled — the next token does not exist yet.

Streaming chunks follow vLLM's ``chat_completion_stream_generator``: a first chunk with the role and
``prompt_token_ids``, one chunk per sampled token with its ``token_ids``, ``logprobs`` and text delta
(incremental detokenization, special tokens skipped: the EOS chunk has empty content), the
``finish_reason`` on the last token's chunk, then the usage chunk and ``[DONE]``. A non-streaming
reply is built by the vLLM wire from the finished sample, exactly as for scripted turns.

Sampling: ``temperature`` (default 1), ``top_p``, ``top_k``, ``seed`` (per request, reproducible
because every prompt is evaluated from scratch); logprobs are the raw model distribution (see
``llama_engine``). Knobs this mode does not implement (penalties, ``min_p``, ``stop`` strings, ``n``)
are refused with a 400 when set to anything but their no-op value, rather than silently ignored.

``GET /_polar/samples`` lists what the engine sampled (prompt ids, token ids, logprobs, finish reason;
the last 100, newest last), so a test can check what the proxy recorded against the model's truth.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from polar_mitm.output_parsers.qwen3 import StreamParser
from polar_mitm.tokens.conversation import RequestError
from polar_mitm.tokens.gguf import load_gguf_tokenizer

from .generation import Sample, token_limit
from .llama_engine import Generation, LlamaEngine, SamplingParams, Step
from .render import Prompt, Renderer
from .scenario import Scenario, Turn
from .server import TOKEN_FLAGS, PolicyServer, ServerConfig
from .vllm_wire import DONE, SSE_CONTENT_TYPE, SYSTEM_FINGERPRINT, VllmWire
from .wire import ChatCall

log = logging.getLogger(__name__)

SAMPLE_LOG_SIZE = 100
#: Request knobs this mode does not implement, with the value that means "off".
_UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "stop": None,
    "stop_token_ids": None,
    "bad_words": None,
    "logit_bias": None,
    "min_tokens": 0,
}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value == off or (off is None and value in ([], {}, ""))


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """The request's sampling knobs; raises :class:`RequestError` for a bad or unsupported one."""
    for key, off in _UNSUPPORTED.items():
        if key in body and not _is_off(body[key], off):
            raise RequestError(
                f"'{key}' is not supported by the real-model policy server", param=key
            )

    def number(key: str, default: float) -> float:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"'{key}' must be a number", param=key)
        return float(value)

    temperature = number("temperature", 1.0)
    if temperature < 0:
        raise RequestError("temperature must be non-negative", param="temperature")
    top_p = number("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    top_k = body.get("top_k", -1)
    if top_k is None:
        top_k = -1
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise RequestError("top_k must be -1 (disable), 0 (disable) or a positive integer", "top_k")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("'seed' must be an integer", param="seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


@dataclass(frozen=True)
class RealModelConfig:
    """The real-model mode's own settings (the CLI's ``--gguf``/``--real`` and friends)."""

    default_max_tokens: int | None = None  # vLLM: the rest of the context


class _Detokenizer:
    """Per-token text deltas, as vLLM's incremental detokenizer yields them (special tokens skipped,
    ``""`` while a multi-byte character is still incomplete)."""

    def __init__(self, renderer: Renderer) -> None:
        from tokenizers.decoders import DecodeStream

        self._renderer = renderer
        self._backend = renderer.tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        with self._renderer._lock:
            return self._stream.step(self._backend, token_id) or ""


class _VllmStream:
    """vLLM's chat-completion stream, built one sampled token at a time."""

    def __init__(
        self, wire: VllmWire, call: ChatCall, served_model: str, prompt_ids: tuple[int, ...]
    ) -> None:
        self.wire = wire
        self.call = call
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": served_model,
        }
        self.n_prompt = len(prompt_ids)
        self.prompt_ids = prompt_ids
        self.hide = not call.include_reasoning
        self.sent = 0

    def _event(self, chunk: dict[str, Any]) -> bytes:
        return b"data: " + _dumps(chunk) + b"\n\n"

    def _usage(self, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.n_prompt,
            "total_tokens": self.n_prompt + completion,
            "completion_tokens": completion,
        }

    def first(self) -> bytes:
        chunk: dict[str, Any] = {
            **self.head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if self.call.continuous_usage:
            chunk["usage"] = self._usage(0)
        chunk["prompt_token_ids"] = list(self.prompt_ids) if self.call.return_token_ids else None
        chunk["prompt_text"] = None  # vLLM 0.32's first chunk names it (vllm_wire.py does too)
        return self._event(chunk)

    def token(
        self, step: Step, token_str: str, delta: dict[str, Any] | None, finish: str | None
    ) -> bytes | None:
        """The chunk for one sampled token (``None`` when vLLM sends nothing for it)."""
        call = self.call
        self.sent += 1
        if delta is not None and self.hide:
            delta.pop("reasoning", None)
            if not delta.get("content") and not delta.get("tool_calls"):
                delta = None
        logprobs = None
        if call.logprobs and not self.hide:
            token = (
                f"token_id:{step.token_id}"
                if call.body.get("return_tokens_as_token_ids")
                else token_str
            )
            entry: dict[str, Any] = {
                "token": token,
                "logprob": step.logprob,
                "bytes": list(token.encode("utf-8", errors="replace")),
            }
            entry["top_logprobs"] = [dict(entry)] if call.top_logprobs else []
            logprobs = {"content": [entry]}
        if delta is None:
            if finish is None and logprobs is None and (not call.return_token_ids or self.hide):
                return None
            delta = {}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": self.wire._delta(delta),
            "logprobs": logprobs,
        }
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = [step.token_id] if call.return_token_ids and not self.hide else None
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if call.continuous_usage:
            chunk["usage"] = self._usage(self.sent)
        return self._event(chunk)

    def usage(self) -> bytes | None:
        if not self.call.include_usage:
            return None
        usage = {**self.head, "choices": [], "usage": self._usage(self.sent)}
        return self._event({**usage, "system_fingerprint": SYSTEM_FINGERPRINT})


class RealModelServer(PolicyServer):
    """The reference server with a real model behind it (vLLM wire kind only)."""

    token_in_routes = False  # scripted token-in turns would not be this model's

    def __init__(
        self,
        config: ServerConfig,
        engine: LlamaEngine,
        real: RealModelConfig | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        if config.kind != "vllm":
            raise ValueError("the real-model mode speaks the vllm wire kind only")
        tokenizer = None if renderer else load_gguf_tokenizer(engine.source, engine.info)
        renderer = renderer or Renderer(engine.source, tokenizer=tokenizer)
        config = replace(
            config, max_model_len=min(config.max_model_len or engine.n_ctx, engine.n_ctx)
        )
        super().__init__(config, renderer)
        self.engine = engine
        self.real = real or RealModelConfig()
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLE_LOG_SIZE)
        self._engine_lock = asyncio.Lock()

    @staticmethod
    def placeholder_scenario(model: str) -> Scenario:
        """The base server wants a scenario (served name, ``/v1/models`` root); no turns are scripted."""
        return Scenario(model=model, scripts=(), source="<real model>")

    def app(
        self, extra_routes: Iterable[Callable[[web.Application, PolicyServer], None]] = ()
    ) -> web.Application:
        def routes(app: web.Application, server: PolicyServer) -> None:
            app.router.add_get("/_polar/samples", self.list_samples)

        return super().app([routes, *extra_routes])

    async def list_samples(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.samples))

    async def reset(self, request: web.Request) -> web.Response:
        self.samples.clear()
        return await super().reset(request)

    # -- chat completions ----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if self.config.ignore_token_flags and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in TOKEN_FLAGS}
        call = self.wire.parse_chat(body, self.served_model)
        try:
            params = sampling_params(call.body)
            prompt = await asyncio.to_thread(self.renderer.prompt, call.render)
            limit = token_limit(
                len(prompt.ids),
                call.max_tokens if call.max_tokens is not None else self.real.default_max_tokens,
                self.max_model_len,
                self.limits,
                call.max_tokens_param,
            )
        except RequestError as e:
            raise self._bad_request(e) from None
        async with self._engine_lock:
            generation = await asyncio.to_thread(self.engine.generate, prompt.ids, params)
            try:
                if call.stream:
                    return await self._stream(request, call, prompt, generation, limit)
                return await self._full(request, call, prompt, generation, limit)
            finally:
                generation.close()

    def _finish_reason(self, step: Step, n: int, limit: int) -> str | None:
        if step.eog:
            return "stop"
        if n >= limit:
            return "length"
        return None

    def _log_sample(self, prompt: Prompt, steps: list[Step], finish: str | None, params) -> None:
        self.samples.append(
            {
                "prompt_token_ids": list(prompt.ids),
                "token_ids": [s.token_id for s in steps],
                "logprobs": [s.logprob for s in steps],
                "finish_reason": finish,
                "temperature": params.temperature,
                "seed": params.seed,
            }
        )

    def _parser(self, call: ChatCall, prompt: Prompt) -> StreamParser:
        r = self.renderer
        return StreamParser(
            think_start_id=r.think_start_id,
            think_end_id=r.think_end_id,
            parse_tools=call.parse_tools,
            reasoning_open=r.reasoning_open_at_end(prompt.ids),
        )

    async def _stream(
        self,
        request: web.Request,
        call: ChatCall,
        prompt: Prompt,
        generation: Generation,
        limit: int,
    ) -> web.StreamResponse:
        assert isinstance(self.wire, VllmWire)
        out = _VllmStream(self.wire, call, self.served_model, prompt.ids)
        parser = self._parser(call, prompt)
        detok = _Detokenizer(self.renderer)
        response = web.StreamResponse(
            status=200, headers={"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        steps: list[Step] = []
        finish: str | None = None
        try:
            await response.write(out.first())
            while finish is None:
                step = await asyncio.to_thread(generation.step)
                steps.append(step)
                finish = self._finish_reason(step, len(steps), limit)
                delta = parser.feed(detok.piece(step.token_id), [step.token_id])
                if (
                    finish == "stop"
                    and parser.tools_streamed
                    and not isinstance(call.tool_choice, Mapping)
                ):
                    finish = "tool_calls"
                event = out.token(step, self.renderer.token_str(step.token_id), delta, finish)
                if event is not None:
                    await response.write(event)
            usage = out.usage()
            if usage is not None:
                await response.write(usage)
            await response.write(DONE)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.info("client went away mid-stream after %d tokens", len(steps))
        finally:
            self._log_sample(prompt, steps, finish, generation.params)
        return response

    async def _full(
        self,
        request: web.Request,
        call: ChatCall,
        prompt: Prompt,
        generation: Generation,
        limit: int,
    ) -> web.StreamResponse:
        detok = _Detokenizer(self.renderer)
        steps: list[Step] = []
        pieces: list[str] = []
        finish: str | None = None
        while finish is None:
            step = await asyncio.to_thread(generation.step)
            steps.append(step)
            pieces.append(detok.piece(step.token_id))
            finish = self._finish_reason(step, len(steps), limit)
        self._log_sample(prompt, steps, finish, generation.params)
        ids = tuple(s.token_id for s in steps)
        sample = Sample(
            prompt_ids=prompt.ids,
            ids=ids,
            pieces=tuple(pieces),
            token_strs=tuple(self.renderer.token_str(i) for i in ids),
            logprobs=tuple(s.logprob for s in steps),
            finish_reason=finish,
            stop_reason=None,
            finish_override=None,
            # no think tokens in the vocabulary: no reasoning parser, every word is content
            reasoning_open=self.renderer.reasoning_open_at_end(prompt.ids)
            if self.renderer.think_end_id is not None
            else False,
            think_ids=(self.renderer.think_start_id, self.renderer.think_end_id),
            turn=Turn(),
            script="<real model>",
        )
        return await self.play(request, self.wire.chat_reply(call, sample, self.served_model))
