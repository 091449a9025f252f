"""A token-in reply as the server's chat endpoint would have sent it (exact-prefix mode).

The token-in endpoint answers with raw generated text and token ids. `TokenInReply` moves the ids
into the call's `TokenTally` (through the upstream module's `take_text`) and turns the text into
chat-completions chunks — a first chunk with the role, then reasoning / content / tool-call deltas
from the model family's output parser, the chunk with the finish reason, the usage — or, for a
whole reply, one chat completion. Everything after it (the dialect's translator, the assembler,
the record) is the chat path's own code, so the harness cannot tell the two paths apart.

The finish reason follows vLLM's chat endpoint: ``tool_calls`` when the parser found a tool call
and the model stopped by itself.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..output_parsers import Family
from ..output_parsers.qwen3 import message_tool_calls
from ..tokens.detok import vllm_text
from ..tokens.tokenizer import PolicyTokenizer
from ..trajectory.exact_prefix import ExactPlan
from ..upstream import TokenTally, Upstream
from ..upstream.base import TextPiece


class TokenInReply:
    def __init__(
        self,
        upstream: Upstream,
        plan: ExactPlan,
        *,
        family: Family,
        tokenizer: PolicyTokenizer,
        tally: TokenTally,
        model: str | None,
        wants_logprobs: bool,
        generate: bool = False,
    ) -> None:
        """``generate``: the reply is vLLM's `/inference/v1/generate` (ids only, whole): its text
        is decoded here as vLLM's completions would have written it (`tokens/detok.py`)."""
        self.upstream = upstream
        self.plan = plan
        self.family = family
        self.tally = tally
        self.tokenizer = tokenizer
        self.wants_logprobs = wants_logprobs
        self.generate = generate
        self.parser = family.stream(
            tokenizer.specials, parse_tools=plan.parse_tools, reasoning_open=plan.reasoning_open
        )
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._started = False

    # -- a stream ----------------------------------------------------------------------------

    def chunks(self, raw: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat chunks for one upstream token-in chunk (maybe none)."""
        piece = self.upstream.take_text(raw, self.tally)
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            out.append(
                {**self.head, "choices": [{**first, "logprobs": None, "finish_reason": None}]}
            )
        delta = self.parser.feed(piece.text, piece.ids) if (piece.text or piece.ids) else None
        finish = self._finish(piece.finish_reason, self.parser.tools_streamed)
        logprobs = self._logprobs(piece)
        if delta or finish or logprobs:
            choice = {
                "index": 0,
                "delta": _chat_delta(delta or {}),
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            out.append({**self.head, "choices": [choice]})
        if raw.get("usage"):
            out.append({**self.head, "choices": [], "usage": raw["usage"]})
        return out

    # -- a whole reply -----------------------------------------------------------------------

    def reply(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for a whole token-in reply."""
        piece = self._whole(raw)
        parsed = self.family.parse(
            piece.text,
            parse_tools=self.plan.parse_tools,
            reasoning_open=self.plan.reasoning_open,
            thinking_enabled=self.plan.thinking_enabled,
        )
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = message_tool_calls(parsed.tool_calls)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(piece),
            "finish_reason": self._finish(piece.finish_reason, bool(parsed.tool_calls)),
        }
        reply = {**self.head, "object": "chat.completion", "choices": [choice]}
        if self.tally.usage:
            reply["usage"] = self.tally.usage
        return reply

    def _whole(self, raw: dict[str, Any]) -> TextPiece:
        if not self.generate:
            return self.upstream.take_text(raw, self.tally)
        piece = self.upstream.take_generated(raw, self.tally)  # type: ignore[attr-defined]
        prompt = self.tally.prompt_ids or ()
        piece.text = vllm_text(
            self.tokenizer, prompt, piece.ids, self.plan.sampling, piece.finish_reason
        )
        return piece

    # -- shared ------------------------------------------------------------------------------

    def _finish(self, natural: str | None, tools_called: bool) -> str | None:
        if natural is None:
            return None
        finish = "tool_calls" if tools_called and natural == "stop" else natural
        self.tally.finish_reason = finish  # the record keeps what the harness was told
        return finish

    def _logprobs(self, piece: TextPiece) -> dict[str, Any] | None:
        """Chat-shaped logprobs, only for a harness that asked for them. The token strings are
        the server's where it sent them (SGLang's triples), else each id decoded here (vLLM's
        token-in reply names its tokens by id)."""
        if not self.wants_logprobs or not piece.logprobs:
            return None
        tokens = piece.tokens if len(piece.tokens) == len(piece.logprobs) else None
        if tokens is None and len(piece.ids) == len(piece.logprobs):
            with self.tokenizer.lock:
                tokens = self.tokenizer.token_strs(piece.ids)
        content = []
        for i, logprob in enumerate(piece.logprobs):
            token = tokens[i] if tokens is not None else ""
            content.append(
                {
                    "token": token,
                    "logprob": logprob,
                    "bytes": list(token.encode("utf-8", "replace")),
                    "top_logprobs": [],
                }
            )
        return {"content": content}


def _chat_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A parser delta in the chat endpoint's field order (content, reasoning, tool_calls)."""
    out: dict[str, Any] = {}
    if "content" in delta:
        out["content"] = delta["content"]
    if "reasoning" in delta:
        out["reasoning"] = delta["reasoning"]
    if delta.get("tool_calls"):
        out["tool_calls"] = delta["tool_calls"]
    return out
