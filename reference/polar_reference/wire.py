"""The seam between the server and a policy-server wire format (vLLM, SGLang).

A wire kind is one module with one class implementing :class:`Wire`: it turns a request body into a
kind-neutral :class:`ChatCall`, and a :class:`~polar_reference.generation.Sample` into a
:class:`ReplyPlan` — the exact bytes to send, chunk by chunk. The server never builds JSON itself, so an
SGLang mode is ``sglang_wire.py`` plus one line in ``wire_kinds.py``. This module imports no wire
kind: they implement it.

A :class:`ReplyPlan` is data, not a coroutine, so fault modes (``faults.py``) can rewrite it in one
place before the server plays it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .render import RenderInput


class WireError(Exception):
    """A request the wire kind rejects; ``body`` is the JSON error object to send with ``status``."""

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(body)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class ChatCall:
    """A chat-completions request reduced to what generation and reply building need."""

    body: dict[str, Any]
    render: RenderInput
    model: str | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the cap's name in the request (vLLM's error texts)
    tool_choice: Any = "none"
    parse_tools: bool = False
    thinking_enabled: bool = True
    include_reasoning: bool = True


@dataclass
class ReplyPlan:
    """What to send for one call. ``events`` are sent in order (one write each) for a stream; a
    non-streaming reply is a single event. ``tokens[i]`` is how many sampled tokens event ``i``
    carries (for ``--token-rate`` pacing). ``final_index`` is the event that ends the generation
    (the chunk with ``finish_reason``; ``0`` for a non-streaming reply): with ``hold`` set, everything
    before it is sent, then the server waits for ``POST /_polar/release`` before sending the rest.

    Fault modes (``faults.py``) set the connection-level knobs: ``abort_after`` (reset the connection
    after that many events; 0 = before the status line) and ``stall_after`` / ``stall_s`` (after that
    many events go silent for ``stall_s`` seconds, or until the client leaves)."""

    status: int
    content_type: str
    events: list[bytes]
    tokens: list[int]
    stream: bool
    final_index: int = 0
    hold: bool = False
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    abort_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0


class Wire(Protocol):
    """What a policy-server wire kind provides."""

    kind: str

    def parse_chat(self, body: Any, served_model: str) -> ChatCall:
        """Validate a ``/v1/chat/completions`` body; raise :class:`WireError` for a bad one."""
        ...

    def chat_reply(self, call: ChatCall, sample: Any, served_model: str) -> ReplyPlan:
        """The bytes for a generated sample, streaming or not, as this kind's server writes them."""
        ...

    def error(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        """This kind's error object."""
        ...

    def invalid_json(self, raw: bytes) -> WireError | None:
        """The error for a body that is not valid JSON (``None`` if it parses)."""
        ...

    def models(self, served_model: str, root: str, max_model_len: int) -> dict[str, Any]:
        """The ``GET /v1/models`` body."""
        ...

    def tokenize(
        self, ids: list[int], max_model_len: int, token_strs: list[str] | None
    ) -> dict[str, Any]:
        """The ``POST /tokenize`` body."""
        ...
