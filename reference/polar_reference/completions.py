"""The reference server's token-in endpoints: vLLM's ``POST /v1/completions`` with a prompt of token
ids, and SGLang's ``POST /generate`` with ``input_ids`` (exact-prefix mode's upstream).

The prompt arrives as ids, not messages, so the scripted turn is found from the ids themselves:
they are decoded and read back as ChatML (Qwen3's format) for what a chat request would have
said — the system block, the first user turn, the tool names in ``<tools>``, the number of
assistant turns before the generation prompt. The turn's output ids are the same real tokenization
the chat endpoint samples (the template's rendering of the scripted assistant turn, through
``<|im_end|>``), with the same logprobs, so both paths of a conversation get the same tokens.

Wire shapes: vLLM's ``CompletionResponse`` / ``CompletionStreamResponse``
(``vllm/entrypoints/openai/completion/protocol.py``: ``text``, ``logprobs`` with ``tokens`` /
``token_logprobs`` / ``text_offset`` / ``top_logprobs``, per-choice ``token_ids`` and
``prompt_token_ids`` with ``return_token_ids`` — in a stream the prompt ids on the first chunk only —
``return_tokens_as_token_ids`` naming each token ``token_id:N``, and a ``null`` ``max_tokens``
meaning 16); SGLang's ``/generate`` reply ``{"text", "output_ids",
"meta_info"}`` with ``output_token_logprobs`` triples when ``return_logprob`` is set (non-streaming
only here).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from array import array
from typing import Any, Protocol

import numpy as np
from aiohttp import web

from polar_mitm.tokens.conversation import RenderInput, RequestError
from polar_mitm.upstream.sglang import SGLANG_SAMPLING_FIELDS

from .generation import fake_logprob, token_limit
from .render import Renderer
from .scenario import Scenario, Turn
from .vllm_wire import SYSTEM_FINGERPRINT, request_stream_interval, stream_groups
from .wire import ReplyPlan, Wire, WireError


class TokenInHost(Protocol):
    """What the token-in endpoints use of the server that mounts them (`server.PolicyServer`).
    A protocol rather than an import: server.py mounts these routes, so this module cannot import
    server.py back without tying the two into an import cycle."""

    renderer: Renderer
    scenario: Scenario
    max_model_len: int
    limits: str  # how the context limits apply: a vLLM version or "sglang" (versions.py)
    served_model: str
    wire: Wire
    control: Any  # server.Control: its ``stats`` counter

    async def _body(self, request: web.Request, ids: str | None = None) -> Any: ...

    def _bad_request(self, e: RequestError) -> WireError: ...

    def check_model(self, model: Any) -> None: ...

    async def play(self, request: web.Request, plan: ReplyPlan) -> web.StreamResponse: ...


DONE = b"data: [DONE]\n\n"
_BLOCK = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_ASSISTANT = "<|im_start|>assistant"
_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default (and what a null becomes)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def read_chatml(text: str) -> tuple[str, str, list[str], int]:
    """(system text, first user text, tool names, assistant turns before the generation prompt)
    of a rendered Qwen3 prompt."""
    system = first_user = None
    for block in _BLOCK.finditer(text):  # as far as both are found: not the whole
        role, body = block.group(1), block.group(2)  # conversation a long prompt re-sends
        if role == "system" and system is None:
            system = body
        elif role == "user" and first_user is None and not body.startswith("<tool_response>"):
            first_user = body
        if system is not None and first_user is not None:
            break
    system, first_user = system or "", first_user or ""
    names = []
    tools = _TOOLS.search(system)
    for line in tools.group(1).splitlines() if tools else ():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    assistant_turns = text.count(_ASSISTANT)
    last = text.rfind(_ASSISTANT)
    if last >= 0 and "<|im_end|>" not in text[last:]:  # the generation prompt: not a turn
        assistant_turns -= 1
    return system, first_user, names, assistant_turns


class TokenInSample:
    """A scripted turn sampled after a prompt given as ids."""

    def __init__(
        self,
        server: TokenInHost,
        prompt: list[int] | array,
        max_tokens: int | None,
        *,
        ints: bool = False,
    ):
        """``ints``: every id is known to be an ``int`` already (`_prompt_ids` looked). An int32
        `array` (the body read by `fastjson.loads_ids`) is checked by numpy: a list's ``min``
        and ``max`` over 50k ids were 1.4 ms of each call."""
        renderer = server.renderer
        if not prompt:
            raise RequestError("the prompt must not be empty", param="prompt")
        vocab = len(renderer.tokenizer)
        bounds = _id_bounds(prompt, ints)
        if bounds is None or bounds[0] < 0 or bounds[1] >= vocab:
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        limit = token_limit(len(prompt), max_tokens, server.max_model_len, server.limits)
        text = renderer.decode_prompt(prompt)
        system, first_user, names, turns = read_chatml(text)
        try:
            script, turn = server.scenario.turn(system, first_user, names, turns)
        except LookupError as e:
            raise RequestError(str(e)) from None
        open_ = renderer.reasoning_open_at_end(prompt)
        kwargs = {"enable_thinking": False} if open_ is False else {}
        # The assistant turn renders the same after any prompt: one stand-in user turn will do.
        stand_in = RenderInput(
            messages=[{"role": "user", "content": "."}], tools=None, kwargs=kwargs
        )
        completion = renderer.completion(stand_in, Turn(**_turn_fields(turn)))
        n = min(len(completion.ids), limit)
        self.prompt = prompt
        self.ids = list(completion.ids[:n])
        self.pieces = list(completion.pieces[:n])
        self.token_strs = list(completion.token_strs[:n])
        self.logprobs = [fake_logprob(i, t) for i, t in enumerate(self.ids)]
        self.finish_reason = "stop" if n == len(completion.ids) else "length"
        self.turn = turn
        self.eos = renderer.eos_token_id

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt), len(self.ids)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}


def _turn_fields(turn: Turn) -> dict[str, Any]:
    return {"reasoning": turn.reasoning, "content": turn.content, "tool_calls": turn.tool_calls}


def _prompt_ids(body: Any) -> list[int] | array:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, array):  # int32 ids, read so by `fastjson.loads_ids`
        return prompt
    if not isinstance(prompt, list) or (prompt and set(map(type, prompt)) != {int}):
        raise RequestError(
            "the reference server's /v1/completions takes 'prompt' as a list of token ids",
            param="prompt",
        )
    return prompt


def _logprobs(sample: TokenInSample, a: int, b: int, offset: int, as_ids: bool) -> dict[str, Any]:
    """vLLM's `CompletionLogProbs` for tokens a..b (`_create_completion_logprobs`): each
    position's top entry is the sampled token itself (`logprobs: 0` still gives it), with
    `return_tokens_as_token_ids` every token is named ``token_id:N``, and the text offsets
    advance by the length of each token's string, whichever it is."""
    tokens = [f"token_id:{i}" for i in sample.ids[a:b]] if as_ids else sample.token_strs[a:b]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    values = sample.logprobs[a:b]
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        # vLLM lists the sampled token's own entry even for ``logprobs: 0``
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
    }


def completion_plan(body: dict[str, Any], sample: TokenInSample, model: str) -> ReplyPlan:
    """vLLM's /v1/completions reply (streaming or not) for a sampled turn."""
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    with_ids = bool(body.get("return_token_ids"))
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    want_lp = body.get("logprobs") is not None
    if not body.get("stream"):
        choice = {
            "index": 0,
            "text": "".join(sample.pieces),
            "logprobs": _logprobs(sample, 0, len(sample.ids), 0, as_ids) if want_lp else None,
            "finish_reason": sample.finish_reason,
            "stop_reason": None,
            "token_ids": sample.ids if with_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(sample.prompt) if with_ids else None,
            "routed_experts": None,
        }
        reply = {
            **head,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {
                **sample.usage,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return ReplyPlan(200, "application/json", [_dumps(reply)], [len(sample.ids)], False)
    events: list[bytes] = []
    tokens: list[int] = []
    offset = 0
    n = len(sample.ids)
    # one token a chunk, or `stream_interval` tokens a chunk (the first alone, the rest last)
    for a, b in stream_groups(n, request_stream_interval(body) or 1):
        logprobs = _logprobs(sample, a, b, offset, as_ids) if want_lp else None
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(sample.pieces[a:b]),
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason if b == n else None,
            "stop_reason": None,
            # set on every chunk, so `model_dump_json(exclude_unset=True)` writes them, null
            # unless return_token_ids asked (the prompt's ids on the first chunk only)
            "prompt_token_ids": list(sample.prompt) if with_ids and a == 0 else None,
            "token_ids": list(sample.ids[a:b]) if with_ids else None,
        }
        if logprobs is not None:  # vLLM advances by the tokens reported (their names' lengths)
            offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        else:
            offset += len(choice["text"])
        events.append(b"data: " + _dumps({**head, "choices": [choice]}) + b"\n\n")
        tokens.append(b - a)
    final_index = max(len(events) - 1, 0)  # the chunk with the finish
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = {
            **head,
            "choices": [],
            "usage": sample.usage,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        events.append(b"data: " + _dumps(usage) + b"\n\n")
        tokens.append(0)
    events.append(DONE)
    tokens.append(0)
    return ReplyPlan(
        200, "text/event-stream; charset=utf-8", events, tokens, True, final_index=final_index
    )


def unknown_sampling_field(params: dict[str, Any]) -> str | None:
    """SGLang's contract error for the first unknown ``sampling_params`` key (None: all known)."""
    for key in params:
        if key not in SGLANG_SAMPLING_FIELDS:  # serde's unknown_field text
            listed = ", ".join(f"`{f}`" for f in SGLANG_SAMPLING_FIELDS)
            return f"unknown field `{key}`, expected one of {listed}"
    return None


def generate_plan(body: dict[str, Any], sample: TokenInSample) -> ReplyPlan:
    """SGLang's /generate reply (non-streaming) for a sampled turn: ``return_text_in_logprobs``
    fills the triples' text (null without it), ``return_prompt_token_ids`` echoes the prompt, and
    a turn whose ``finish_reason`` is ``abort`` ends as a graceful abort does (HTTP 200)."""
    if sample.turn.finish_reason == "abort":  # scheduler.py FINISH_ABORT("Aborted").to_json()
        finish: dict[str, Any] = {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
    elif sample.finish_reason == "stop":
        finish = {"type": "stop", "matched": sample.eos}
    else:
        finish = {"type": "length", "length": len(sample.ids)}
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(sample.prompt),
        "completion_tokens": len(sample.ids),
        "cached_tokens": 0,
    }
    if body.get("return_logprob"):
        texts = (
            sample.token_strs if body.get("return_text_in_logprobs") else [None] * len(sample.ids)
        )
        meta["output_token_logprobs"] = [
            [lp, i, t] for lp, i, t in zip(sample.logprobs, sample.ids, texts, strict=True)
        ]
    reply: dict[str, Any] = {"text": "".join(sample.pieces), "output_ids": sample.ids}
    if body.get("return_prompt_token_ids"):
        reply["prompt_token_ids"] = list(sample.prompt)
    reply["meta_info"] = meta
    return ReplyPlan(200, "application/json", [_dumps(reply)], [len(sample.ids)], False)


def add_routes(app: web.Application, server: TokenInHost) -> None:
    """``/v1/completions`` for the vLLM kind, ``/generate`` for the SGLang kind."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await server._body(request, ids="prompt")
        if not isinstance(body, dict):
            raise server._bad_request(RequestError("the body must be a JSON object"))
        server.check_model(body.get("model"))
        server.control.stats["completion_requests"] += 1
        max_tokens = body.get("max_tokens")
        max_tokens = _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        try:
            try:
                request_stream_interval(body)
            except ValueError as e:
                raise RequestError(str(e), param="stream_interval") from None
            prompt = _prompt_ids(body)
            sample = await asyncio.to_thread(TokenInSample, server, prompt, max_tokens, ints=True)
        except RequestError as e:
            raise server._bad_request(e) from None
        plan = completion_plan(body, sample, server.served_model)
        plan.hold, plan.delay_s = sample.turn.hold_last, sample.turn.delay_s
        return await server.play(request, plan)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await server._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list):
            raise server._bad_request(RequestError("'input_ids' (a list of token ids) is required"))
        if body.get("stream"):
            raise server._bad_request(RequestError("the reference /generate does not stream"))
        params = body.get("sampling_params") or {}
        unknown = unknown_sampling_field(params) if isinstance(params, dict) else None
        if unknown is not None:  # http_server.py generate_request's contract gate
            return web.json_response({"error": unknown}, status=400)
        server.control.stats["generate_requests"] += 1
        try:
            sample = await asyncio.to_thread(
                TokenInSample, server, body["input_ids"], params.get("max_new_tokens", 128)
            )
        except RequestError as e:
            raise server._bad_request(e) from None
        plan = generate_plan(body, sample)
        plan.hold, plan.delay_s = sample.turn.hold_last, sample.turn.delay_s
        return await server.play(request, plan)

    if server.wire.kind == "sglang":
        app.router.add_post("/generate", generate)
    else:
        app.router.add_post("/v1/completions", completions)


def _id_bounds(prompt: list[int] | array, ints: bool) -> tuple[int, int] | None:
    """The smallest and largest id of a prompt; None when an id is not an ``int``."""
    if isinstance(prompt, array):
        values = np.frombuffer(prompt, dtype=np.int32)
        return int(values.min()), int(values.max())
    if not ints and set(map(type, prompt)) != {int}:
        return None
    return min(prompt), max(prompt)
