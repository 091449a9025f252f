"""vLLM's OpenAI chat-completions wire format, byte for byte where it matters.

Shapes follow ``vllm/entrypoints/openai/chat_completion/{protocol,serving}.py``: non-streaming replies
are ``ChatCompletionResponse.model_dump()`` (every field, ``null`` included; ``tool_calls`` omitted when
empty); stream chunks are ``model_dump_json(exclude_unset=True)``, so a field appears exactly when vLLM
sets it — ``prompt_token_ids`` (``null`` unless asked for) only on the first chunk, ``token_ids`` and
``logprobs`` on every later one, ``stop_reason`` only with the ``finish_reason``; the usage chunk is
``exclude_none`` and has ``choices: []``. Errors are ``ErrorResponse``: ``{"error": {"message", "type",
"param", "code"}}`` (``NotFoundError``/404 for an unknown model, ``Bad Request``/400 for a body that
fails validation, ``BadRequestError``/400 for one vLLM refuses later).

The reasoning field is ``reasoning`` (current vLLM); ``reasoning_content`` (vLLM <= 0.10) or ``both``
(the 0.11 transition, where deltas carried both keys) are options.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from polar_mitm.output_parsers.qwen3 import StreamParser, message_tool_calls, parse_output
from polar_mitm.tokens.conversation import (
    RenderInput,
    RequestError,
    normalize_messages,
    normalize_tools,
    template_kwargs,
)

from .generation import Sample
from .versions import VLLM_VERSION
from .wire import ChatCall, ReplyPlan, WireError

REASONING_FIELDS = ("reasoning", "reasoning_content", "both")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
DONE = b"data: [DONE]\n\n"
#: vLLM's ``system_fingerprint`` is ``vllm-<version>-<build hash>`` (a string in every reply)
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-reference"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _validation_message(
    err_type: str, loc: tuple, msg: str, inp: Any, ctx: dict | None = None
) -> str:
    err: dict[str, Any] = {"type": err_type, "loc": loc, "msg": msg, "input": inp}
    if ctx is not None:
        err["ctx"] = ctx
    return f"1 validation error:\n  {err}"


def stream_groups(n: int, interval: int) -> list[tuple[int, int]]:
    """Token slices per streamed chunk as vLLM's output processor sends them with a stream
    interval (`vllm/v1/engine/output_processor.py`): the first token alone, then a chunk each
    time ``interval`` more tokens have come, and the rest with the finish."""
    if n == 0:
        return []
    groups, start = [(0, 1)], 1
    while start < n:
        groups.append((start, min(start + interval, n)))
        start += interval
    return groups


def request_stream_interval(body: Mapping[str, Any]) -> int | None:
    """A request's ``stream_interval`` (vLLM >= 0.32, chat and completions): an int >= 1 or
    null; anything else is the ValueError vLLM's request validation gives (HTTP 400)."""
    value = body.get("stream_interval")
    if value is None:
        return None
    if type(value) is not int:
        raise ValueError("stream_interval: Input should be a valid integer")
    if value < 1:
        raise ValueError("stream_interval: Input should be greater than or equal to 1")
    return value


class VllmWire:
    """The vLLM wire kind (see the module docstring)."""

    kind = "vllm"

    def __init__(self, *, reasoning_field: str = "reasoning", chunk_tokens: int = 1):
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(f"reasoning_field must be one of {REASONING_FIELDS}")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.reasoning_field = reasoning_field
        self.chunk_tokens = chunk_tokens

    # -- errors ------------------------------------------------------------------------------

    def error(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        return {"error": {"message": message, "type": err_type, "param": param, "code": status}}

    def _bad_request(self, message: str, param: str | None = None) -> WireError:
        return WireError(400, self.error(400, message, "BadRequestError", param))

    def _invalid(self, message: str, param: str | None) -> WireError:
        """A body that fails request validation (FastAPI's RequestValidationError handler)."""
        return WireError(400, self.error(400, message, "Bad Request", param))

    def invalid_json(self, raw: bytes) -> WireError | None:
        try:
            json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            pos = getattr(e, "pos", 0) or 0
            reason = getattr(e, "msg", str(e))
            message = _validation_message(
                "json_invalid", ("body", pos), "JSON decode error", {}, {"error": reason}
            )
            return self._invalid(message, f"body.{pos}")
        return None

    def not_found(self, model: str) -> WireError:
        return WireError(
            404, self.error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        )

    # -- requests ----------------------------------------------------------------------------

    def parse_chat(self, body: Any, served_model: str) -> ChatCall:
        if not isinstance(body, Mapping):
            raise self._invalid(
                _validation_message(
                    "model_attributes_type",
                    ("body",),
                    "Input should be a valid dictionary or object to extract fields from",
                    body,
                ),
                "body",
            )
        if "messages" not in body:
            raise self._invalid(
                _validation_message("missing", ("body", "messages"), "Field required", body),
                "body.messages",
            )
        stream = bool(body.get("stream") or False)
        stream_options = body.get("stream_options")
        if stream_options and not stream:
            raise self._bad_request(
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                "stream_options",
            )
        if stream_options is not None and not isinstance(stream_options, Mapping):
            raise self._invalid("stream_options must be an object", "body.stream_options")
        logprobs = bool(body.get("logprobs") or False)
        top_logprobs = body.get("top_logprobs") or 0
        if not isinstance(top_logprobs, int) or (top_logprobs < 0 and top_logprobs != -1):
            raise self._bad_request(
                "`top_logprobs` must be a positive value or -1.", "top_logprobs"
            )
        if top_logprobs and not logprobs:
            raise self._bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if body.get("n") not in (None, 1):
            raise self._bad_request("n > 1 is not supported by the reference policy server.", "n")
        try:
            request_stream_interval(body)
        except ValueError as e:
            raise self._invalid(str(e), "body.stream_interval") from None
        tools_raw = body.get("tools")
        if "tool_choice" in body:
            tool_choice = body["tool_choice"]
        else:
            tool_choice = "auto" if tools_raw else "none"
        if tool_choice not in ("none", None) and not tools_raw:
            raise self._bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and not isinstance(max_tokens, int):
            raise self._invalid("max_tokens must be an integer", "body.max_tokens")
        # vLLM checks the model after validating the body and before rendering the messages.
        model = body.get("model")
        if model and model != served_model:
            raise self.not_found(model)
        try:
            kwargs = template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
            render = RenderInput(
                messages=normalize_messages(body["messages"]),
                tools=normalize_tools(tools_raw),
                kwargs=kwargs,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        except RequestError as e:
            raise self._bad_request(str(e), e.param) from None
        include_usage = bool(stream and stream_options and stream_options.get("include_usage"))
        return ChatCall(
            body=dict(body),
            render=render,
            model=model,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=include_usage and bool(stream_options.get("continuous_usage_stats")),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            return_token_ids=bool(body.get("return_token_ids") or False),
            max_tokens=max_tokens,
            max_tokens_param=(
                "max_completion_tokens"
                if body.get("max_completion_tokens") is not None
                else "max_tokens"
            ),
            tool_choice=tool_choice,
            parse_tools=bool(render.tools) and tool_choice != "none",
            thinking_enabled=kwargs.get("enable_thinking", True) is not False,
            include_reasoning=body.get("include_reasoning", True) is not False,
        )

    # -- replies -----------------------------------------------------------------------------

    def _logprob_entries(self, call: ChatCall, sample: Sample) -> list[dict[str, Any]]:
        as_ids = bool(call.body.get("return_tokens_as_token_ids"))
        entries = []
        for token_id, token, lp in zip(sample.ids, sample.token_strs, sample.logprobs, strict=True):
            if as_ids:
                token = f"token_id:{token_id}"
            entry = {
                "token": token,
                "logprob": lp,
                "bytes": list(token.encode("utf-8", errors="replace")),
            }
            top = [dict(entry)] if call.top_logprobs else []
            entry["top_logprobs"] = top
            entries.append(entry)
        return entries

    def _finish(self, call: ChatCall, sample: Sample, tools_called: bool) -> str:
        """vLLM 0.33's ``resolve_finish_reason`` (``serve/utils/tool_calls_utils.py``), streaming
        or not: ``tool_calls`` only when calls were made, the model stopped by itself (a cut
        call keeps ``length``) and no single named tool was forced."""
        if sample.finish_override:
            return sample.finish_override
        natural = sample.finish_reason
        named = isinstance(call.tool_choice, Mapping)
        return "tool_calls" if tools_called and natural == "stop" and not named else natural

    def _put_reasoning(self, target: dict[str, Any], value: Any) -> None:
        if self.reasoning_field in ("reasoning", "both"):
            target["reasoning"] = value
        if self.reasoning_field in ("reasoning_content", "both"):
            target["reasoning_content"] = value

    def _delta(self, delta: Mapping[str, Any]) -> dict[str, Any]:
        """A parser delta in DeltaMessage field order (role, content, reasoning, tool_calls)."""
        out: dict[str, Any] = {}
        if "role" in delta:
            out["role"] = delta["role"]
        if "content" in delta:
            out["content"] = delta["content"]
        if "reasoning" in delta:
            self._put_reasoning(out, delta["reasoning"])
        if delta.get("tool_calls"):
            out["tool_calls"] = delta["tool_calls"]
        return out

    def chat_reply(self, call: ChatCall, sample: Sample, served_model: str) -> ReplyPlan:
        if call.stream:
            return self._stream(call, sample, served_model)
        return self._full(call, sample, served_model)

    def _usage(self, sample: Sample) -> dict[str, Any]:
        """With a reasoning parser loaded vLLM also counts the reasoning tokens (those between
        ``<think>`` and ``</think>``; ``CompletionTokenUsageInfo``)."""
        p, c = len(sample.prompt_ids), len(sample.ids)
        return {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens(sample)},
        }

    def _full(self, call: ChatCall, sample: Sample, served_model: str) -> ReplyPlan:
        # When the prompt itself closed the think block (enable_thinking: false) all output is content.
        parsed = parse_output(
            sample.text,
            thinking_enabled=call.thinking_enabled,
            parse_tools=call.parse_tools,
            reasoning=sample.reasoning_open is not False,
        )
        content = parsed.content
        if call.parse_tools and (
            isinstance(call.tool_choice, Mapping) or call.tool_choice == "required"
        ):
            content = content or ""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if parsed.tool_calls:
            message["tool_calls"] = message_tool_calls(parsed.tool_calls)
        self._put_reasoning(message, parsed.reasoning if call.include_reasoning else None)
        hide = not call.include_reasoning
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._logprob_entries(call, sample)}
            if call.logprobs and not hide
            else None,
            "finish_reason": self._finish(call, sample, bool(parsed.tool_calls)),
            "stop_reason": sample.stop_reason,
            "token_ids": list(sample.ids) if call.return_token_ids and not hide else None,
            "routed_experts": None,
        }
        usage = self._usage(sample)
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served_model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {**usage, "prompt_tokens_details": None},
            "prompt_logprobs": None,
            "prompt_token_ids": list(sample.prompt_ids) if call.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return ReplyPlan(
            status=200,
            content_type=JSON_CONTENT_TYPE,
            events=[_dumps(body)],
            tokens=[len(sample.ids)],
            stream=False,
        )

    def _stream(self, call: ChatCall, sample: Sample, served_model: str) -> ReplyPlan:
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": served_model,
        }
        n_prompt = len(sample.prompt_ids)
        hide = not call.include_reasoning
        events: list[bytes] = []
        tokens: list[int] = []

        def emit(chunk: dict[str, Any], n_tokens: int) -> None:
            events.append(b"data: " + _dumps(chunk) + b"\n\n")
            tokens.append(n_tokens)

        first = {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if call.continuous_usage:
            first["usage"] = {
                "prompt_tokens": n_prompt,
                "total_tokens": n_prompt,
                "completion_tokens": 0,
            }
        first["prompt_token_ids"] = list(sample.prompt_ids) if call.return_token_ids else None
        first["prompt_text"] = None
        emit(first, 0)

        parser = StreamParser(
            think_start_id=sample.think_ids[0],
            think_end_id=sample.think_ids[1],
            parse_tools=call.parse_tools,
            reasoning_open=sample.reasoning_open,
        )
        entries = self._logprob_entries(call, sample) if call.logprobs and not hide else None
        # the request's stream_interval raises the server's (chunk_tokens), never lowers it
        interval = max(self.chunk_tokens, request_stream_interval(call.body) or 1)
        groups = stream_groups(len(sample.ids), interval)
        sent = 0
        final_index = 0
        skipped = 0  # tokens of chunks vLLM drops: still generated, so still paced
        for gi, (a, b) in enumerate(groups):
            finished = gi == len(groups) - 1
            ids = sample.ids[a:b]
            delta = parser.feed("".join(sample.pieces[a:b]), ids)
            if delta is not None and hide:
                delta.pop("reasoning", None)
                if not delta.get("content") and not delta.get("tool_calls"):
                    delta = None
            logprobs = {"content": entries[a:b]} if entries is not None else None
            if delta is None:
                if not finished and logprobs is None and (not call.return_token_ids or hide):
                    skipped += b - a
                    continue
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": self._delta(delta), "logprobs": logprobs}
            if finished:
                if choice["delta"].get("content") == "":  # vLLM's last chunk: an empty delta
                    del choice["delta"]["content"]
                choice["finish_reason"] = self._finish(call, sample, parser.tools_streamed)
                choice["stop_reason"] = sample.stop_reason
            else:
                choice["finish_reason"] = None
            choice["token_ids"] = list(ids) if call.return_token_ids and not hide else None
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            sent = b
            if call.continuous_usage:
                chunk["usage"] = {
                    "prompt_tokens": n_prompt,
                    "total_tokens": n_prompt + sent,
                    "completion_tokens": sent,
                }
            if finished:
                final_index = len(events)
            emit(chunk, b - a + skipped)
            skipped = 0
        if call.include_usage:
            usage_chunk = {**head, "choices": [], "usage": self._usage(sample)}
            emit({**usage_chunk, "system_fingerprint": SYSTEM_FINGERPRINT}, 0)
        events.append(DONE)
        tokens.append(0)
        return ReplyPlan(
            status=200,
            content_type=SSE_CONTENT_TYPE,
            events=events,
            tokens=tokens,
            stream=True,
            final_index=final_index,
        )

    # -- other endpoints ---------------------------------------------------------------------

    def models(self, served_model: str, root: str, max_model_len: int) -> dict[str, Any]:
        created = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": served_model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [permission],
        }
        return {"object": "list", "data": [card]}

    def tokenize(
        self, ids: list[int], max_model_len: int, token_strs: list[str] | None
    ) -> dict[str, Any]:
        return {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": token_strs,
        }


def reasoning_tokens(sample: Sample) -> int:
    """The sampled tokens inside the think block: after ``<think>`` (or from the start when the
    prompt left the block open) up to ``</think>``; 0 when the prompt closed it."""
    if sample.reasoning_open is False:
        return 0
    start_id, end_id = sample.think_ids
    ids = list(sample.ids)
    start = 0
    if sample.reasoning_open is None:
        if start_id not in ids:
            return 0
        start = ids.index(start_id) + 1
    end = ids.index(end_id, start) if end_id in ids[start:] else len(ids)
    return max(0, end - start)
