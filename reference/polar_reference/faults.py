"""Fault modes: the one place where a scripted turn's ``fault`` field changes what is sent.

A fault is a function ``(spec, plan) -> plan`` over the finished :class:`ReplyPlan` (status, headers and
the exact bytes of every event), registered in :data:`FAULTS` under the name a scenario uses::

    {"content": "...", "fault": "drop_token_ids"}                # a bare name
    {"content": "...", "fault": {"mode": "reset", "after": 3}}   # a name with parameters

A test can also arm a fault for one request without a scenario file: ``POST /_polar/faults`` with
``{"key": "<first user message>", "fault": {...}}`` (or a list of them); the next request whose first
user message is exactly ``key`` gets that fault instead of its turn's (see ``server.py``).

Modes (``after``/``at`` count events of the stream as the wire built it: the first chunk is 0):

* ``http_error`` — ``status`` (default 503), ``body``: ``"json"`` (the server's error object, the
  default), ``"none"`` (empty), a string (sent as text/plain) or an object (sent as JSON);
  ``retry_after`` adds that header. Replaces the whole reply.
* ``reset`` — send ``after`` events (default 1), then reset the connection (TCP RST). ``after: 0``
  resets before the status line (also for non-streaming replies).
* ``stall`` — send ``after`` events (default 1), then go silent for ``seconds`` (default 60) or until
  the client leaves, then send the rest. ``after: 0`` stalls before the status line.
* ``truncate`` — send ``after`` events (default 1), then end the response cleanly: no finish chunk,
  no ``[DONE]``. A non-streaming body is cut to ``after`` bytes (default: half).
* ``bad_json`` — event ``at`` (default 1) becomes ``data: {"choices": [{"delta": ...`` (not JSON).
* ``error_event`` — after ``after`` events (default 1), send ``data: {"error": {...}}`` and end, as
  vLLM does when generation fails mid-stream.
* ``drop_token_ids`` — remove every token field (``prompt_token_ids``, ``token_ids``, ``meta_info``)
  from the reply, as a server that ignores the flags would send it.
* ``lose_token_ids`` — the last ``count`` (default 1) sampled ids go missing from ``token_ids``
  while ``usage`` still counts them, as when a vLLM bug dropped tool-call tokens from streams:
  the stream's last ``count`` chunks that carry ids lose them; a whole reply's list loses its tail.
* ``drop_usage`` — remove the usage (chunk or field).
* ``flood`` — a long, fast stream: ``chunks`` (default 2000) content chunks of ``bytes`` (default
  4096) characters each, one token id each, then the finish chunk, usage and ``[DONE]``.
* ``replay`` — send ``data`` (a string, or ``data_b64`` for bytes) as the whole body, cut into
  ``pieces`` writes (a list of lengths, optional), with ``status`` (200) and ``content_type``
  (``text/event-stream``). Replaces the whole reply: used to feed arbitrary bytes to the proxy's
  SSE parser and translators.

Modes that replace the whole reply (:data:`STANDALONE`) need no generation, so an armed one skips it.
Unknown modes are logged once and ignored so scenario files written for a newer server still play.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from typing import Any

from .wire import ReplyPlan

log = logging.getLogger(__name__)

FaultFn = Callable[[dict[str, Any], ReplyPlan], ReplyPlan]
SSE = "text/event-stream; charset=utf-8"
_TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "meta_info")

_warned: set[str] = set()


def _int(spec: dict[str, Any], key: str, default: int) -> int:
    value = spec.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _error_object(status: int, message: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": status}
    }


def http_error(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    status = _int(spec, "status", 503)
    body = spec.get("body", "json")
    headers: dict[str, str] = {}
    if spec.get("retry_after") is not None:
        headers["Retry-After"] = str(spec["retry_after"])
    if body == "none" or body is None:
        events, content_type = [b""], "text/plain"
    elif body == "json":
        events = [json.dumps(_error_object(status, f"injected fault: HTTP {status}")).encode()]
        content_type = "application/json"
    elif isinstance(body, str):
        events, content_type = [body.encode()], "text/plain; charset=utf-8"
    else:
        events, content_type = [json.dumps(body).encode()], "application/json"
    return ReplyPlan(status, content_type, events, [0], stream=False, headers=headers)


def reset(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    plan.abort_after = _int(spec, "after", 1)
    return plan


def stall(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    plan.stall_after = _int(spec, "after", 1)
    seconds = spec.get("seconds", 60.0)
    plan.stall_s = float(seconds) if isinstance(seconds, (int, float)) else 60.0
    return plan


def truncate(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    if plan.stream:
        n = _int(spec, "after", 1)
        plan.events, plan.tokens = plan.events[:n], plan.tokens[:n]
        plan.final_index = min(plan.final_index, max(n - 1, 0))
        plan.hold = False
    else:
        body = b"".join(plan.events)
        plan.events = [body[: _int(spec, "after", len(body) // 2)]]
    return plan


def bad_json(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    at = min(_int(spec, "at", 1), len(plan.events) - 1)
    if plan.stream:
        plan.events[at] = b'data: {"choices": [{"delta": {"content": "x"\n\n'
    else:
        plan.events = [b'{"id": "chatcmpl-broken", "choices": [']
    return plan


def error_event(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    n = _int(spec, "after", 1)
    error = _error_object(500, str(spec.get("message", "injected fault: the engine failed")))
    plan.events = plan.events[:n] + [b"data: " + json.dumps(error).encode() + b"\n\n"]
    plan.tokens = plan.tokens[:n] + [0]
    plan.final_index, plan.hold = min(plan.final_index, n), False
    return plan


def _rewrite_json(plan: ReplyPlan, edit: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Apply ``edit`` to every JSON object of the plan (each ``data:`` event, or the one body);
    ``None`` from ``edit`` drops the event."""
    out, tokens = [], []
    for event, n in zip(plan.events, plan.tokens, strict=True):
        raw = event[6:].strip() if plan.stream else event
        if plan.stream and (not event.startswith(b"data: {")):
            out.append(event)
            tokens.append(n)
            continue
        obj = edit(json.loads(raw))
        if obj is None:
            continue
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        out.append(b"data: " + body + b"\n\n" if plan.stream else body)
        tokens.append(n)
    plan.events, plan.tokens = out, tokens
    plan.final_index = min(plan.final_index, max(len(out) - 1, 0))


def drop_token_ids(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    def edit(obj: dict[str, Any]) -> dict[str, Any]:
        for key in _TOKEN_FIELDS:
            obj.pop(key, None)
        for choice in obj.get("choices") or ():
            for key in _TOKEN_FIELDS:
                choice.pop(key, None)
        return obj

    _rewrite_json(plan, edit)
    return plan


def lose_token_ids(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    count = _int(spec, "count", 1)
    if not plan.stream:

        def cut(obj: dict[str, Any]) -> dict[str, Any]:
            for choice in obj.get("choices") or ():
                if isinstance(choice.get("token_ids"), list):
                    choice["token_ids"] = choice["token_ids"][
                        : max(len(choice["token_ids"]) - count, 0)
                    ]
            return obj

        _rewrite_json(plan, cut)
        return plan
    objects = [e for e in plan.events if e.startswith(b"data: {")]  # what `edit` is called on
    carrying = [i for i, event in enumerate(objects) if b'"token_ids":[' in event]
    lose = set(carrying[-count:]) if count > 0 else set()
    seen = iter(range(len(objects)))

    def edit(obj: dict[str, Any]) -> dict[str, Any]:
        if next(seen) in lose:
            for choice in obj.get("choices") or ():
                choice.pop("token_ids", None)
        return obj

    _rewrite_json(plan, edit)
    return plan


def drop_usage(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    def edit(obj: dict[str, Any]) -> dict[str, Any] | None:
        if plan.stream and not obj.get("choices") and "usage" in obj:
            return None
        obj.pop("usage", None)
        return obj

    _rewrite_json(plan, edit)
    return plan


def flood(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    if not plan.stream:
        return plan
    n, size = max(_int(spec, "chunks", 2000), 0), max(_int(spec, "bytes", 4096), 1)
    first = json.loads(plan.events[0][6:])
    head = {k: first[k] for k in ("id", "object", "created", "model")}

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def choice(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            "token_ids": ids,
        }

    content = event({**head, "choices": [choice({"content": "x" * size}, [87])]})
    finish = event({**head, "choices": [choice({}, [151645], "stop")]})
    prompt = len(first.get("prompt_token_ids") or ())
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + n + 1, "completion_tokens": n + 1}
    # One shared bytes object for every content chunk: the server stays small however long the flood.
    plan.events = [
        plan.events[0],
        *[content] * n,
        finish,
        event({**head, "choices": [], "usage": usage}),
        b"data: [DONE]\n\n",
    ]
    plan.tokens = [0, *[1] * n, 1, 0, 0]
    plan.final_index, plan.hold = n + 1, False
    return plan


def replay(spec: dict[str, Any], plan: ReplyPlan) -> ReplyPlan:
    if isinstance(spec.get("data_b64"), str):
        data = base64.b64decode(spec["data_b64"])
    else:
        data = str(spec.get("data", "")).encode("utf-8", "surrogatepass")
    pieces = spec.get("pieces")
    events: list[bytes] = []
    if isinstance(pieces, list) and all(isinstance(p, int) and p > 0 for p in pieces):
        at = 0
        for size in pieces:
            events.append(data[at : at + size])
            at += size
        events.append(data[at:])
    else:
        events = [data]
    events = [e for e in events if e] or [b""]
    return ReplyPlan(
        status=_int(spec, "status", 200),
        content_type=str(spec.get("content_type", SSE)),
        events=events,
        tokens=[0] * len(events),
        stream=True,
    )


#: Fault modes by name.
FAULTS: dict[str, FaultFn] = {
    "http_error": http_error,
    "reset": reset,
    "stall": stall,
    "truncate": truncate,
    "bad_json": bad_json,
    "error_event": error_event,
    "drop_token_ids": drop_token_ids,
    "lose_token_ids": lose_token_ids,
    "drop_usage": drop_usage,
    "flood": flood,
    "replay": replay,
}
#: Modes that replace the whole reply: an armed one needs no generation.
STANDALONE = frozenset({"http_error", "replay"})


def fault_spec(raw: Any) -> dict[str, Any] | None:
    """Normalize a turn's ``fault`` field to ``{"mode": name, ...}`` (``None`` for no fault)."""
    if raw is None or raw is False or raw == "":
        return None
    if isinstance(raw, str):
        return {"mode": raw}
    if isinstance(raw, dict) and isinstance(raw.get("mode"), str):
        return dict(raw)
    return {"mode": repr(raw)}


def apply_fault(raw: Any, plan: ReplyPlan) -> ReplyPlan:
    """Apply the turn's fault (if any) to the plan about to be sent."""
    spec = fault_spec(raw)
    if spec is None:
        return plan
    fn = FAULTS.get(spec["mode"])
    if fn is None:
        if spec["mode"] not in _warned:
            _warned.add(spec["mode"])
            log.warning("unknown fault mode %r ignored", spec["mode"])
        return plan
    return fn(spec, plan)
