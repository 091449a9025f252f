"""The small interface every policy server implements: ask for token fields, take them out.

An upstream module knows one server's extra request flags and where that server puts prompt ids,
sampled ids and logprobs in its replies. `take_chunk` / `take_reply` move those into a
`TokenTally` and delete them from the JSON, so everything downstream handles plain OpenAI
chat-completions objects. Adding a server is one module with one `Upstream` subclass.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

log = logging.getLogger("polar_mitm")


@dataclass(slots=True)
class TokenTally:
    """What the server told us about tokens for one call."""

    prompt_ids: Sequence[int] | None = None  # a list from a reply, int32 array when sent
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    saw_output_ids: bool = False  # the server sent an output-ids field at all (even empty)
    flags: list[str] = field(default_factory=list)  # anomalies in the token fields (record flags)
    abort_message: str | None = None  # SGLang's `abort` finish: why the server stopped

    def count_check(self) -> str:
        """`ok` when the sampled ids match the server's usage count (a vLLM bug once dropped
        tool-call tokens in streams), `mismatch` when not, `no_usage` when there is no count."""
        completion = (self.usage or {}).get("completion_tokens")
        if not isinstance(completion, int):
            return "no_usage"
        return "ok" if completion == len(self.output_ids) else "mismatch"


@dataclass(slots=True)
class TextPiece:
    """What one token-in reply (or stream chunk) adds: raw generated text and its token ids.

    Exact-prefix mode's output parser turns these into chat deltas; `tokens` are the tokens'
    own strings where the server gave them (for chat-shaped logprobs to a harness that asked)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def chat_body(chat: dict[str, Any], *, model: str | None, stream: bool) -> dict[str, Any]:
    """What every server's chat request shares: a copy of the dialect's chat body with the model
    to serve and the streaming mode, and on a stream ``stream_options.include_usage`` (the usage
    count the sampled ids are checked against); each module adds its own token flags."""
    body = dict(chat)
    if model:
        body["model"] = model
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body.pop("stream_options", None)
    return body


class Upstream(ABC):
    kind: ClassVar[str]
    # Whether chat streaming works together with the token flags. An SGLang without sglext ids
    # refuses it, so the call goes upstream non-streaming and the harness's stream is
    # synthesized; an instance may change it once it knows its server (SGLang's probe).
    streams_with_tokens: bool = True
    chat_path: ClassVar[str] = "/v1/chat/completions"
    # How this server normalizes a conversation before its chat template (`tokens/conversation.py`):
    # what the no-ids fallback must reproduce to recompute prompt ids.
    template_flavor: ClassVar[str] = "vllm"
    # False for servers that never return token ids (kind `openai`): every record is retokenized.
    returns_ids: ClassVar[bool] = True

    # The token-in endpoint (exact-prefix mode): a prompt given as token ids, raw text back.
    # None: the server has none, and exact-prefix mode sends every call the chat way.
    token_in_path: ClassVar[str | None] = None
    token_in_streams: ClassVar[bool] = True
    # Whether a request's `stream_interval` (tokens per streamed chunk) is honoured: vLLM >= 0.32.
    takes_stream_interval: ClassVar[bool] = False

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._warned_missing_ids = False

    def warn_missing_ids(self, fallback: str) -> None:
        """Say once per upstream (not per call) that a reply came back without token ids."""
        if self._warned_missing_ids or not self.returns_ids:
            return
        self._warned_missing_ids = True
        log.warning(
            "polar-mitm: upstream %s (%s) returned no token ids: the server ignores the token "
            "flags (older than the versions in docs/upstreams.md?); %s",
            self.base_url,
            self.kind,
            fallback,
        )

    @property
    def chat_url(self) -> str:
        return self.base_url + self.chat_path

    @property
    def token_in_url(self) -> str:
        return self.base_url + (self.token_in_path or "")

    def token_in_body(
        self, prompt_ids: Any, sampling: dict[str, Any], *, model: str | None, stream: bool
    ) -> dict[str, Any]:
        """The token-in request: `prompt_ids` verbatim (a list of ids, or their JSON list as a
        `msgspec.Raw`: the proxy keeps a long chain's text), the chat request's sampling
        parameters (`exact_prefix.sampling`: OpenAI names, `max_tokens` always set) in this
        server's form."""
        raise NotImplementedError(f"{self.kind} has no token-in endpoint")

    def token_in_unsupported(self, sampling: dict[str, Any]) -> str | None:
        """Why these sampling parameters cannot go to the token-in endpoint (None: they can);
        the call then goes the chat way with this as the note's reason."""
        return None

    def take_text(self, obj: dict[str, Any], tally: TokenTally) -> TextPiece:
        """Move the token fields of one token-in chunk or reply into `tally`; the text piece."""
        raise NotImplementedError(f"{self.kind} has no token-in endpoint")

    @abstractmethod
    def request_body(
        self, chat: dict[str, Any], *, model: str | None, stream: bool, top_logprobs: int
    ) -> dict[str, Any]:
        """The upstream body: the dialect's chat body plus this server's token flags."""

    @abstractmethod
    def take_chunk(self, chunk: dict[str, Any], tally: TokenTally) -> None:
        """Move token fields of one stream chunk into `tally`, deleting them from `chunk`."""

    @abstractmethod
    def take_reply(self, reply: dict[str, Any], tally: TokenTally) -> None:
        """The same for a whole (non-streaming) reply."""

    def take_logprobs(self, choice: dict[str, Any], tally: TokenTally) -> None:
        """OpenAI-shaped `logprobs.content[].logprob`, shared by the servers that use it."""
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            content = logprobs.get("content")
            if content:
                tally.logprobs.extend(float(entry.get("logprob", 0.0)) for entry in content)
