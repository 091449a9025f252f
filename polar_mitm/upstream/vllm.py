"""vLLM's chat completions with token ids (vLLM >= 0.10.2).

Request: `return_token_ids`, `logprobs`, `top_logprobs`, and for streams
`stream_options.include_usage` so the sampled-id count can be checked against usage.
Reply: top-level `prompt_token_ids` (in a stream: the first chunk only), per choice `token_ids`
(in a stream: that chunk's new ids) and `logprobs.content[]`.

Token-in (exact-prefix mode): `POST /v1/completions` with `prompt` as a list of ids,
`logprobs: 0` (the sampled token's logprob only) and `return_tokens_as_token_ids`, which writes
each sampled token in `logprobs.tokens` as `"token_id:N"`: the sampled ids and their logprobs,
and nothing else. Not `return_token_ids`: it echoes the whole prompt's ids too (the first chunk
of a stream), which the proxy sent itself — 436 KB of JSON at 60k tokens, for the server to write
and the proxy to read on every call. The reply carries, per choice, `text`,
`logprobs.token_logprobs` / `logprobs.tokens`, `finish_reason` and `stop_reason`, and `usage`
(its `prompt_tokens` is checked against the ids sent). vLLM's completions default `max_tokens` is
16 (a `null` is reset to it), so the body always carries the real cap. Fields as in vLLM's
`entrypoints/openai/completion/{protocol,serving}.py` (`_create_completion_logprobs`, 0.32/0.33).

Token-in through ``POST /inference/v1/generate`` (``polar_token_in=generate``; vLLM >= 0.32 started
with ``--enable-scale-out``, else HTTP 403): ``{"model", "token_ids", "sampling_params": {...,
"logprobs": 0, "detokenize": false}, "output_mode": "tokens"}``, never streamed. The server's
incremental detokenizer does not run (its cost grows with the prompt); the reply's
``choices[0].token_ids``, ``logprobs.content[].logprob``, ``finish_reason``, ``stop_reason`` and
``usage`` are read here and the proxy rebuilds the text (`tokens/detok.py`). Fields as in
``entrypoints/scale_out/token_in_token_out/{protocol,serving}.py`` (``GenerateRequest``,
``GenerateTokensResponse``).
"""

from __future__ import annotations

from typing import Any

from .base import TextPiece, TokenTally, Upstream, chat_body

GENERATE_PATH = "/inference/v1/generate"
# What a 403 / 404 from it means, for the harness's error (`call/exchange.py`).
GENERATE_FIX = (
    "polar_token_in=generate needs vLLM >= 0.32 started with --enable-scale-out "
    "(or set polar_token_in=completions)"
)


class VLLM(Upstream):
    kind = "vllm"
    token_in_path = "/v1/completions"
    takes_stream_interval = True  # CompletionRequest / ChatCompletionRequest, vLLM >= 0.32

    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        body = chat_body(chat, model=model, stream=stream)
        body["return_token_ids"] = True
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs
        return body

    def take_chunk(self, chunk: dict[str, Any], tally: TokenTally) -> None:
        prompt = chunk.pop("prompt_token_ids", None)
        if prompt is not None:
            tally.prompt_ids = prompt
        choices = chunk.get("choices")
        if choices:
            self._take_choice(choices[0], tally)
            for extra in choices[1:]:
                extra.pop("token_ids", None)
        usage = chunk.get("usage")
        if usage:
            tally.usage = usage
        if tally.model is None:
            tally.model = chunk.get("model")

    def take_reply(self, reply: dict[str, Any], tally: TokenTally) -> None:
        self.take_chunk(reply, tally)

    def _take_choice(self, choice: dict[str, Any], tally: TokenTally) -> None:
        ids = choice.pop("token_ids", None)
        if ids is not None:
            tally.saw_output_ids = True
            tally.output_ids.extend(ids)
        self.take_logprobs(choice, tally)
        finish = choice.get("finish_reason")
        if finish:
            tally.finish_reason = finish

    def token_in_body(
        self, prompt_ids: Any, sampling: dict[str, Any], *, model: str | None, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt_ids, **sampling}
        if model:
            body["model"] = model
        body["stream"] = stream
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def generate_url(self) -> str:
        return self.base_url + GENERATE_PATH

    def generate_body(
        self, prompt_ids: Any, sampling: dict[str, Any], *, model: str | None
    ) -> dict[str, Any]:
        """The `/inference/v1/generate` request: the chat names are SamplingParams' own."""
        params = {**sampling, "logprobs": 0, "detokenize": False}
        body: dict[str, Any] = {"token_ids": prompt_ids, "sampling_params": params}
        if model:
            body["model"] = model
        body["output_mode"] = "tokens"
        return body

    def take_generated(self, obj: dict[str, Any], tally: TokenTally) -> TextPiece:
        """The ids, logprobs and finish of a `/inference/v1/generate` reply (text left empty:
        the caller decodes the ids)."""
        piece = TextPiece()
        choices = obj.pop("choices", None) or ()
        if choices:
            choice = choices[0]
            ids = choice.get("token_ids")
            if not isinstance(ids, list):
                raise TypeError(f"token_ids is {type(ids).__name__}, not a list")
            piece.ids = ids
            logprobs = choice.get("logprobs")
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            if content is not None:
                if len(content) != len(ids):
                    raise ValueError(f"{len(ids)} token ids but {len(content)} logprobs")
                piece.logprobs = [float(entry["logprob"]) for entry in content]
                tally.logprobs.extend(piece.logprobs)
            tally.saw_output_ids = True
            tally.output_ids.extend(ids)
        return _close(piece, choices[0] if choices else None, obj, tally)

    def take_text(self, obj: dict[str, Any], tally: TokenTally) -> TextPiece:
        piece = TextPiece()
        choices = obj.pop("choices", None) or ()
        if choices:
            choice = choices[0]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                tokens = logprobs.get("tokens") or ()
                values = logprobs.get("token_logprobs") or ()
                if len(values) != len(tokens):
                    raise ValueError(f"{len(tokens)} tokens but {len(values)} logprobs")
                piece.ids = [_token_id(t) for t in tokens]
                piece.logprobs = [float(v) if v is not None else 0.0 for v in values]
                tally.saw_output_ids = True
                tally.output_ids.extend(piece.ids)
                tally.logprobs.extend(piece.logprobs)
            text = choice.get("text")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"text is {type(text).__name__}, not a string")
            piece.text = text or ""
        return _close(piece, choices[0] if choices else None, obj, tally)


def _close(
    piece: TextPiece, choice: dict[str, Any] | None, obj: dict[str, Any], tally: TokenTally
) -> TextPiece:
    """What either token-in reply ends with: the choice's finish and stop reasons, then the
    object's usage and model."""
    if choice is not None:
        piece.finish_reason = choice.get("finish_reason")
        piece.stop_reason = choice.get("stop_reason")
        if piece.finish_reason:
            tally.finish_reason = piece.finish_reason
    usage = obj.get("usage")
    if usage:
        tally.usage = usage
    if tally.model is None:
        tally.model = obj.get("model")
    return piece


_TOKEN_ID = "token_id:"


def _token_id(token: Any) -> int:
    """A sampled token as `return_tokens_as_token_ids` writes it: ``"token_id:N"``."""
    if not isinstance(token, str) or not token.startswith(_TOKEN_ID):
        raise ValueError(f"logprobs token {str(token)[:40]!r} is not 'token_id:N'")
    return int(token[len(_TOKEN_ID) :])
