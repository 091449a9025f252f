"""Plain OpenAI-compatible servers that return no token ids (``polar_upstream_kind=openai``).

Nothing is asked beyond what the harness asked, except ``stream_options.include_usage`` on
streams so the server's token counts are there to check against. Every record from such a server
goes through the no-ids fallback (`tokens/retokenize.py`): prompt ids from the policy tokenizer's chat
template (vLLM's normalization, the common one), output ids from the reply's text, both counts
checked against ``usage``; the records say ``ids_source = retokenized`` and are not trainable
unless ``polar_trust_retokenized`` is set.
"""

from __future__ import annotations

from typing import Any

from .base import TokenTally, Upstream, chat_body


class OpenAICompatible(Upstream):
    kind = "openai"
    returns_ids = False

    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        return chat_body(chat, model=model, stream=stream)

    def take_chunk(self, chunk: dict[str, Any], tally: TokenTally) -> None:
        choices = chunk.get("choices")
        if choices:
            self.take_logprobs(choices[0], tally)
            if choices[0].get("finish_reason"):
                tally.finish_reason = choices[0]["finish_reason"]
        if chunk.get("usage"):
            tally.usage = chunk["usage"]
        if tally.model is None:
            tally.model = chunk.get("model")

    def take_reply(self, reply: dict[str, Any], tally: TokenTally) -> None:
        self.take_chunk(reply, tally)
