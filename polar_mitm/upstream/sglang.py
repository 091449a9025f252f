"""SGLang's chat completions with token ids (SGLang 0.5.23; docs/upstreams.md cites the source).

Non-streaming request: ``return_prompt_token_ids``, ``return_meta_info``, ``return_token_ids`` and
``logprobs`` (the triples are only in ``meta_info`` with logprobs on). SGLang refuses those three
flags together with ``stream: true`` (400). The reply, per choice: ``prompt_token_ids``,
``response_token_ids`` (0.5.23's name; ``token_ids`` in the PR #30917 builds before it) and
``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples; all are the raw
generated ids (EOS included), before the reasoning and tool-call parsers.

Streaming with ids (0.5.23): ``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext`` are
allowed with ``stream: true``; the chunks are ordinary chat chunks (logprobs per chunk), and after
the finish chunk one ``choices: []`` chunk carries ``sglext: {input_ids, output_ids: [[...]]}``.
Whether the server has them is probed once per upstream, at no cost: the first call goes the
non-streaming way with the sglext flags added, and a reply with ``sglext.output_ids`` switches
later streaming calls to real streaming (``streams_with_tokens``). An older SGLang ignores the
unknown flags and keeps the non-streaming path, where the harness's stream is synthesized.

Token-in (exact-prefix mode): SGLang's native ``POST /generate`` with ``input_ids`` and
``sampling_params``, which rejects unknown keys (400, ``unknown field `min_tokens```): the chat
names are mapped (``max_tokens`` -> ``max_new_tokens``, ``min_tokens`` -> ``min_new_tokens``,
``seed`` -> ``sampling_seed``, ``include_stop_str_in_output`` -> ``no_stop_trim``) and a
parameter with no SGLang form sends the call the chat way. ``return_logprob`` and
``return_text_in_logprobs`` (else the triples' text is null); not ``return_prompt_token_ids``: the
proxy sent the prompt's ids itself, and an echo of them is the largest part of a long call's reply
(``meta_info.prompt_tokens`` is checked against the ids sent instead). The reply is ``{"text",
"output_ids", "meta_info": {"finish_reason": {"type", "matched" | "length" | "message"},
"prompt_tokens", "completion_tokens", "output_token_logprobs"}}``; a finish of type ``abort``
(HTTP 200) is a failed call, not a ``stop``.

Also normalized here, so everything downstream sees one chat-completions shape whatever the server:
the assistant's ``reasoning_content`` is renamed ``reasoning`` (vLLM's current name) in replies, and
an earlier assistant turn's ``reasoning`` is sent as ``reasoning_content`` (SGLang's request model has
no ``reasoning`` field and would drop the prior thinking from the prompt). ``tool_calls[].index`` is
removed from whole replies (OpenAI has none there; in 0.5.23 it is the call's ordinal).
"""

from __future__ import annotations

from typing import Any

from .base import TextPiece, TokenTally, Upstream, chat_body

_ID_FLAGS = ("return_prompt_token_ids", "return_meta_info", "return_token_ids")
_SGLEXT_FLAGS = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")
# Chat sampling names -> SGLang's sampling_params names (the rest are the same).
_SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}
# Every key SGLang 0.5.23's /generate sampling_params accepts, in its schema's order
# (sglang/api/v1/api_types.py SamplingParams: "unknown keys rejected"). The reference server's
# /generate refuses the others with the same list.
SGLANG_SAMPLING_FIELDS = [
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
]
_SGLANG_SAMPLING = frozenset(SGLANG_SAMPLING_FIELDS)


class SGLang(Upstream):
    kind = "sglang"
    template_flavor = "sglang"
    token_in_path = "/generate"
    token_in_streams = False

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.streams_with_tokens = False  # until a reply shows sglext ids (the probe)

    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        streaming = stream and self.streams_with_tokens  # else: the harness's stream synthesized
        body = chat_body(chat, model=model, stream=streaming)
        if "messages" in body:
            body["messages"] = _with_reasoning_content(body["messages"])
        for flag in _ID_FLAGS:  # refused beside stream: true
            if streaming:
                body.pop(flag, None)
            else:
                body[flag] = True
        for flag in _SGLEXT_FLAGS:
            body[flag] = True
        body["logprobs"] = True
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
        else:
            body.pop("top_logprobs", None)
        return body

    def take_reply(self, reply: dict[str, Any], tally: TokenTally) -> None:
        ext = self._take_sglext(reply)
        choices = reply.get("choices") or []
        for i, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            prompt = choice.pop("prompt_token_ids", None)
            ids = choice.pop("response_token_ids", None)
            older = choice.pop("token_ids", None)  # PR #30917's builds before 0.5.23
            meta = choice.pop("meta_info", None)
            message = choice.get("message")
            if isinstance(message, dict):
                _normalize_message(message)
            if i == 0:
                if ids is None:
                    ids = older
                if ids is None and isinstance(ext.get("output_ids"), list) and ext["output_ids"]:
                    ids = ext["output_ids"][0]
                if prompt is None:
                    prompt = ext.get("input_ids")
                self._take_choice(choice, prompt, ids, meta, tally)
        if reply.get("usage"):
            tally.usage = reply["usage"]
        if tally.model is None:
            tally.model = reply.get("model")

    def _take_sglext(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Remove the ids from an ``sglext`` object (and the object once empty); what it held.
        A reply with output ids there proves the server streams with ids (the probe)."""
        sglext = obj.get("sglext")
        if not isinstance(sglext, dict):
            return {}
        taken = {k: sglext.pop(k) for k in ("input_ids", "output_ids") if k in sglext}
        if not sglext:
            obj.pop("sglext")
        if isinstance(taken.get("output_ids"), list):
            self.streams_with_tokens = True
        return taken

    def take_chunk(self, chunk: dict[str, Any], tally: TokenTally) -> None:
        """A chunk of an sglext stream: logprobs per chunk, the ids in the last ``choices: []``
        chunk's ``sglext``. Per-chunk ``token_ids`` (PR #37365, not merged) are read too."""
        ext = self._take_sglext(chunk)
        if ext:
            prompt, outputs = ext.get("input_ids"), ext.get("output_ids")
            if isinstance(prompt, list):
                tally.prompt_ids = prompt
            if isinstance(outputs, list) and outputs:
                if not isinstance(outputs[0], list):
                    raise TypeError("sglext.output_ids is not a list of lists")
                if tally.saw_output_ids and tally.output_ids != outputs[0]:
                    tally.flags.append("sglang_ids_disagree")
                tally.saw_output_ids = True
                tally.output_ids[:] = outputs[0]
        for i, choice in enumerate(chunk.get("choices") or ()):
            prompt = choice.pop("prompt_token_ids", None)
            ids = choice.pop("token_ids", None)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if "reasoning_content" in delta:
                    value = delta.pop("reasoning_content")
                    if value is not None:
                        delta["reasoning"] = value
                for call in delta.get("tool_calls") or ():
                    if isinstance(call, dict) and isinstance(call.get("function"), dict):
                        function = call["function"]
                        if function.get("name") is None:
                            function.pop("name", None)
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
        if finish == "abort" and isinstance(meta, dict):
            _take_abort(meta.get("finish_reason"), tally)

    def token_in_unsupported(self, sampling: dict[str, Any]) -> str | None:
        for key in sampling:
            if _SAMPLING_NAMES.get(key, key) not in _SGLANG_SAMPLING:
                return f"no_sglang_form: {key}"
        return None

    def token_in_body(
        self, prompt_ids: Any, sampling: dict[str, Any], *, model: str | None, stream: bool
    ) -> dict[str, Any]:
        params = {_SAMPLING_NAMES.get(k, k): v for k, v in sampling.items()}
        unknown = sorted(set(params) - _SGLANG_SAMPLING)
        if unknown:  # token_in_unsupported sent such calls the chat way
            raise ValueError(f"sampling parameters with no SGLang /generate form: {unknown}")
        return {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "stream": False,
        }

    def take_text(self, obj: dict[str, Any], tally: TokenTally) -> TextPiece:
        piece = TextPiece()
        text = obj.pop("text", None)
        if text is not None and not isinstance(text, str):
            raise TypeError(f"text is {type(text).__name__}, not a string")
        piece.text = text or ""
        ids = obj.pop("output_ids", None)
        obj.pop("prompt_token_ids", None)  # not asked for: the ids sent are the prompt
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
            kind = finish.get("type")
            piece.finish_reason = kind if kind in ("length", "abort") else "stop"
            piece.stop_reason = finish.get("matched")
            if kind == "abort":
                _take_abort(finish, tally)
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


def _take_abort(finish: Any, tally: TokenTally) -> None:
    """SGLang's ``{"type": "abort", "message": ...}``: the reason, for the harness's error."""
    message = finish.get("message") if isinstance(finish, dict) else None
    tally.abort_message = str(message) if message else "the server aborted the generation"


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
