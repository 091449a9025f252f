"""SGLang's chat completions with token ids (SGLang main since PR #23751, 2026-06-04).

Request: ``return_prompt_token_ids``, ``return_meta_info``, ``logprobs`` (the ids of the sampled
tokens are only in ``meta_info.output_token_logprobs`` when logprobs are on) and ``return_token_ids``
(PR #30917, 2026-07; a server without it ignores the unknown field). SGLang refuses all three id
flags together with ``stream: true`` (400), so the call always goes upstream non-streaming and the
exchange synthesizes the harness's stream from the whole reply (``streams_with_tokens = False``).

Reply, per choice: ``prompt_token_ids``; ``token_ids`` (with ``return_token_ids``); ``meta_info`` with
``output_token_logprobs`` as ``[logprob, token_id, text]`` triples. Sampled ids come from ``token_ids``
when present, else from the triples; both are the raw generated ids (EOS included), before the
reasoning and tool-call parsers. docs/upstreams.md has the sources and the versions.

Token-in (exact-prefix mode): SGLang's native ``POST /generate`` with ``input_ids`` and
``sampling_params`` (``max_new_tokens``, ``temperature``, ...; ``io_struct.py::GenerateReqInput``),
``return_logprob: true``; non-streaming, like the chat path. The reply is ``{"text", "output_ids",
"meta_info": {"finish_reason": {"type", "matched"}, "prompt_tokens", "completion_tokens",
"output_token_logprobs": [[logprob, id, text], ...]}}``.

Also normalized here, so everything downstream sees one chat-completions shape whatever the server:
the assistant's ``reasoning_content`` is renamed ``reasoning`` (vLLM's current name) in replies, and
an earlier assistant turn's ``reasoning`` is sent as ``reasoning_content`` (SGLang's request model has
no ``reasoning`` field and would drop the prior thinking from the prompt). The non-streaming
``tool_calls[].index`` SGLang adds (the tool's position in ``tools``, not the call's) is removed.
"""

from __future__ import annotations

from typing import Any

from .base import TextPiece, TokenTally, Upstream

_ID_FLAGS = ("return_prompt_token_ids", "return_meta_info", "return_token_ids")
# OpenAI sampling names -> SGLang's sampling_params names (the rest are the same).
_SAMPLING_NAMES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}


class SGLang(Upstream):
    kind = "sglang"
    streams_with_tokens = False
    template_flavor = "sglang"
    token_in_path = "/generate"
    token_in_streams = False

    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        body = dict(chat)
        if model:
            body["model"] = model
        if "messages" in body:
            body["messages"] = _with_reasoning_content(body["messages"])
        body["stream"] = False
        body.pop("stream_options", None)
        for flag in _ID_FLAGS:
            body[flag] = True
        body["logprobs"] = True
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
        else:
            body.pop("top_logprobs", None)
        return body

    def take_reply(self, reply: dict[str, Any], tally: TokenTally) -> None:
        choices = reply.get("choices") or []
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            prompt = choice.pop("prompt_token_ids", None)
            ids = choice.pop("token_ids", None)
            meta = choice.pop("meta_info", None)
            message = choice.get("message")
            if isinstance(message, dict):
                _normalize_message(message)
            if i == 0:
                self._take_choice(choice, prompt, ids, meta, tally)
        sglext = reply.get("sglext")
        if isinstance(sglext, dict):  # PR #34488's response-level ids, when a server sends them
            sglext.pop("input_ids", None)
            sglext.pop("output_ids", None)
            if not sglext:
                reply.pop("sglext")
        if reply.get("usage"):
            tally.usage = reply["usage"]
        if tally.model is None:
            tally.model = reply.get("model")

    def take_chunk(self, chunk: dict[str, Any], tally: TokenTally) -> None:
        """Not used today (SGLang cannot stream with the id flags); kept correct for a server
        that streams per-chunk ``token_ids`` and a first-chunk ``prompt_token_ids`` (PR #37365)."""
        for i, choice in enumerate(chunk.get("choices") or ()):
            prompt = choice.pop("prompt_token_ids", None)
            ids = choice.pop("token_ids", None)
            delta = choice.get("delta")
            if isinstance(delta, dict) and "reasoning_content" in delta:
                delta["reasoning"] = delta.pop("reasoning_content")
            if i == 0:
                if prompt is not None:
                    tally.prompt_ids = prompt
                if ids is not None:
                    tally.saw_output_ids = True
                    tally.output_ids.extend(ids)
                self.take_logprobs(choice, tally)
                if choice.get("finish_reason"):
                    tally.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            tally.usage = chunk["usage"]
        if tally.model is None:
            tally.model = chunk.get("model")

    def _take_choice(
        self,
        choice: dict[str, Any],
        prompt: Any,
        ids: Any,
        meta: Any,
        tally: TokenTally,
    ) -> None:
        if isinstance(prompt, list):
            tally.prompt_ids = prompt
        triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        triple_ids: list[int] | None = None
        triple_lps: list[float] | None = None
        if isinstance(triples, list):
            try:
                triple_lps = [float(t[0]) for t in triples]
                triple_ids = [int(t[1]) for t in triples]
            except (TypeError, ValueError, IndexError):
                tally.flags.append("sglang_malformed_triples")
                triple_ids = triple_lps = None
        if isinstance(ids, list):
            tally.saw_output_ids = True
            tally.output_ids.extend(ids)
            if triple_ids is not None and triple_ids != ids:
                tally.flags.append("sglang_ids_disagree")
        elif triple_ids is not None:
            tally.saw_output_ids = True
            tally.output_ids.extend(triple_ids)
        if triple_lps is not None and len(triple_lps) == len(tally.output_ids):
            tally.logprobs.extend(triple_lps)
        else:
            self.take_logprobs(choice, tally)
        finish = choice.get("finish_reason")
        if finish:
            tally.finish_reason = finish

    def token_in_body(
        self, prompt_ids: list[int], sampling: dict[str, Any], *, model: str | None, stream: bool
    ) -> dict[str, Any]:
        params = {_SAMPLING_NAMES.get(k, k): v for k, v in sampling.items()}
        return {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "stream": False,
        }

    def take_text(self, obj: dict[str, Any], tally: TokenTally) -> TextPiece:
        piece = TextPiece()
        text = obj.pop("text", None)
        if text is not None and not isinstance(text, str):
            raise TypeError(f"text is {type(text).__name__}, not a string")
        piece.text = text or ""
        ids = obj.pop("output_ids", None)
        meta = obj.pop("meta_info", None)
        meta = meta if isinstance(meta, dict) else {}
        triples = meta.get("output_token_logprobs")
        if isinstance(triples, list):
            piece.logprobs = [float(t[0]) for t in triples]
            triple_ids = [int(t[1]) for t in triples]
            piece.tokens = [t[2] if len(t) > 2 and isinstance(t[2], str) else "" for t in triples]
            if isinstance(ids, list) and ids != triple_ids:
                tally.flags.append("sglang_ids_disagree")
            ids = triple_ids
        if isinstance(ids, list):
            tally.saw_output_ids = True
            piece.ids = [int(i) for i in ids]
            tally.output_ids.extend(piece.ids)
            if len(piece.logprobs) == len(piece.ids):
                tally.logprobs.extend(piece.logprobs)
        finish = meta.get("finish_reason")
        if isinstance(finish, dict):
            piece.finish_reason = "length" if finish.get("type") == "length" else "stop"
            piece.stop_reason = finish.get("matched")
        elif isinstance(finish, str):
            piece.finish_reason = finish
        if piece.finish_reason:
            tally.finish_reason = piece.finish_reason
        prompt_tokens, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if isinstance(prompt_tokens, int) and isinstance(completion, int):
            tally.usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }
        return piece


def _with_reasoning_content(messages: Any) -> Any:
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        if (
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and message.get("reasoning")
            and not message.get("reasoning_content")
        ):
            message = {
                ("reasoning_content" if k == "reasoning" else k): v for k, v in message.items()
            }
        out.append(message)
    return out


def _normalize_message(message: dict[str, Any]) -> None:
    if "reasoning_content" in message:
        value = message.pop("reasoning_content")
        if value is not None or "reasoning" not in message:
            message["reasoning"] = value
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            call.pop("index", None)
