"""vLLM's chat completions with token ids (vLLM >= 0.10.2).

Request: `return_token_ids`, `logprobs`, `top_logprobs`, and for streams
`stream_options.include_usage` so the sampled-id count can be checked against usage.
Reply: top-level `prompt_token_ids` (in a stream: the first chunk only), per choice `token_ids`
(in a stream: that chunk's new ids) and `logprobs.content[]`.
"""

from __future__ import annotations

from typing import Any

from .base import TokenTally, Upstream


class VLLM(Upstream):
    kind = "vllm"

    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        body = dict(chat)
        if model:
            body["model"] = model
        body["stream"] = stream
        body["return_token_ids"] = True
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs
        if stream:
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream_options", None)
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
