"""Prompt token counts for requests answered without the policy server (Anthropic count_tokens).

With a `polar_tokenizer` that has a chat template the count is exact: the chat body is
normalized the way the configured server kind does it (`conversation.render_input`) and
rendered with the generation prompt, so it is the length of the `prompt_token_ids` the server
would report. Images are left out (the text-only templates this targets never render them).
With a tokenizer without a chat template (tiktoken) the text of the messages and tools is
encoded; without a tokenizer the count is estimated as one token per 4 bytes, which is what a
harness needs a count for: deciding when its context is getting full.

Blocking (milliseconds for a long prompt): call it from a worker thread.
"""

from __future__ import annotations

import json
from typing import Any

from .conversation import RequestError, render_input
from .tokenizer import PolicyTokenizer


class PromptCounter:
    """`dialects.LocalContext` over the policy tokenizer (if any)."""

    def __init__(self, tokenizer: PolicyTokenizer | None, flavor: str = "vllm") -> None:
        self.tokenizer = tokenizer
        self.flavor = flavor

    def prompt_tokens(self, chat: dict[str, Any]) -> int:
        tok = self.tokenizer
        text_only = _without_images(chat)
        if tok is not None and tok.has_chat_template:
            try:
                inp = render_input(text_only, self.flavor)
            except RequestError:
                inp = None
            if inp is not None:
                with tok.lock:
                    text = tok.render(
                        inp.messages, inp.tools, inp.kwargs, generation=inp.add_generation_prompt
                    )
                    return len(tok.encode(text))
        text = _plain_text(text_only)
        if tok is not None:
            with tok.lock:
                return len(tok.encode(text))
        return (len(text.encode()) + 3) // 4


def _without_images(chat: dict[str, Any]) -> dict[str, Any]:
    messages = []
    for message in chat.get("messages") or ():
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") or "" for p in content if p.get("type") == "text"]
            message = {**message, "content": "\n".join(texts)}
        messages.append(message)
    return {**chat, "messages": messages}


def _plain_text(chat: dict[str, Any]) -> str:
    pieces = []
    for message in chat.get("messages") or ():
        pieces.append(str(message.get("content") or ""))
        if message.get("reasoning"):
            pieces.append(str(message["reasoning"]))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            pieces.append(f"{function.get('name', '')} {function.get('arguments', '')}")
    if chat.get("tools"):
        pieces.append(json.dumps(chat["tools"], ensure_ascii=False))
    return "\n".join(pieces)
