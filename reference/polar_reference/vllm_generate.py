"""The reference server's vLLM 0.32 token-in / token-out endpoint: ``POST /inference/v1/generate``.

As vLLM answers it (``vllm/entrypoints/scale_out/``): without ``--enable-scale-out`` every
scale-out route answers HTTP 403 with ``PermissionDeniedError`` (``factories.py``); with it, a
``GenerateRequest`` (``token_ids``, ``sampling_params``, ``output_mode``) gets the scripted turn
after those ids (`completions.TokenInSample`, the same tokens and logprobs as ``/v1/completions``)
as a ``GenerateTokensResponse``, in the field order pydantic's ``model_dump`` writes: ids and
``logprobs.content[].{token_id, logprob, rank, top_logprobs}``, no text. Stop strings with
``detokenize: false`` are refused (400) as ``SamplingParams`` refuses them. Non-streaming only
here (the proxy never streams it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from polar_mitm.tokens.conversation import RequestError

from .completions import TokenInHost, TokenInSample, _dumps
from .wire import ReplyPlan, WireError

PATH = "/inference/v1/generate"
DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_MAX_TOKENS = 16  # SamplingParams' default (the reference does not apply vLLM's server default)


def generate_reply(sample: TokenInSample, model: str, with_logprobs: bool) -> dict[str, Any]:
    """vLLM's ``GenerateTokensResponse.model_dump()`` for a sampled turn."""
    content = None
    if with_logprobs:
        content = [
            {
                "token_id": i,
                "logprob": lp,
                "rank": 1,
                "top_logprobs": [{"token_id": i, "logprob": lp, "rank": 1}],
            }
            for i, lp in zip(sample.ids, sample.logprobs, strict=True)
        ]
    choice = {
        "index": 0,
        "finish_reason": sample.finish_reason,
        "stop_reason": None,
        "token_ids": sample.ids,
        "routed_experts": None,
        "sampling_mask": None,
        # one span over the outputs: a server whose weights were never updated calls them "default"
        "weight_versions": (
            [{"version": "default", "start": 0, "end": len(sample.ids)}] if sample.ids else None
        ),
        "logprobs": {"content": content} if with_logprobs else None,
    }
    p, c = len(sample.prompt), len(sample.ids)
    return {
        "request_id": f"generate-tokens-{uuid.uuid4().hex}",
        "model": model,
        "created": int(time.time()),
        "usage": {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice],
    }


def _params(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int}:
        raise RequestError("token_ids: a non-empty list of token ids is required", "token_ids")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise RequestError("sampling_params: Field required", "sampling_params")
    if params.get("stop") and params.get("detokenize") is False:
        raise RequestError(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop."
        )
    if body.get("stream"):
        raise RequestError("the reference /inference/v1/generate does not stream", "stream")
    return params


def add_routes(app: web.Application, server: TokenInHost, enabled: bool) -> None:
    """``/inference/v1/generate`` on a vLLM-kind server: 403 unless ``enabled``."""

    async def generate(request: web.Request) -> web.StreamResponse:
        if not enabled:
            error = server.wire.error(403, DISABLED, "PermissionDeniedError")
            raise WireError(403, error)
        body = await server._body(request)
        try:
            params = _params(body)
        except RequestError as e:
            raise server._bad_request(e) from None
        server.check_model(body.get("model"))
        server.control.stats["generate_requests"] += 1
        max_tokens = params.get("max_tokens", _MAX_TOKENS)
        try:
            sample = await asyncio.to_thread(TokenInSample, server, body["token_ids"], max_tokens)
        except RequestError as e:
            raise server._bad_request(e) from None
        reply = generate_reply(sample, server.served_model, params.get("logprobs") is not None)
        plan = ReplyPlan(200, "application/json", [_dumps(reply)], [len(sample.ids)], False)
        plan.hold, plan.delay_s = sample.turn.hold_last, sample.turn.delay_s
        return await server.play(request, plan)

    app.router.add_post(PATH, generate)
