"""SGLang's OpenAI chat-completions wire format, for ``policy-server --kind sglang``.

Modelled on ``sglang.launch_server --reasoning-parser qwen3 --tool-call-parser qwen25`` serving a
Qwen3 model, from SGLang main (``python/sglang/srt/entrypoints/openai/{protocol,serving_chat,
serving_base}.py``, ``managers/tokenizer_manager.py``, ``parser/reasoning_parser.py``,
``function_call/qwen25_detector.py``) between PR #23751 (2026-06-04: ``return_prompt_token_ids``,
``return_meta_info``) and after PR #30917 (2026-07: ``return_token_ids`` on chat). docs/upstreams.md
lists the facts and their sources. The code is ours, the behaviour theirs:

* Request: the conversation is normalized the SGLang way (:func:`polar_mitm.tokens.conversation.
  sglang_render_input`). ``stream: true`` together with ``return_prompt_token_ids``,
  ``return_meta_info`` or ``return_token_ids`` is refused with 400 (SGLang's messages). The model
  name is not checked; the reply echoes it (``"default"`` when absent).
* Reply (non-streaming): ``ChatCompletionResponse`` — ``{id (the request id, bare hex), object,
  created, model, choices, usage, metadata: {weight_version}}``; each choice ``{index, message: {role,
  content, reasoning_content, tool_calls}, logprobs, finish_reason, matched_stop}`` plus, only when
  asked, ``prompt_token_ids`` (``return_prompt_token_ids`` or ``return_token_ids``), ``token_ids``
  (``return_token_ids``) and ``meta_info`` (``return_meta_info``: the engine's dict, with
  ``output_token_logprobs`` as ``[logprob, token_id, text]`` triples when ``logprobs`` is set).
  ``content`` is never ``null`` (``""``). Token ids include the EOS the model sampled;
  ``matched_stop`` is that EOS id (``null`` once tool calls turned the reason into ``tool_calls``).
* Reasoning (qwen3 detector, current main): a leading ``<think>`` is dropped, the text before
  ``</think>`` is ``reasoning_content`` and the rest the content, unstripped; without ``</think>``
  the text up to a ``<tool_call>`` is reasoning. With ``enable_thinking: false`` and no ``<think>``
  the whole text is content.
* Tool calls (qwen25 detector): content is the text before the first ``<tool_call>``, stripped; each
  ``<tool_call>{json}</tool_call>`` becomes ``{id: "call_" + 24 hex, index: <the tool's position in
  tools>, type, function: {name, arguments: json.dumps(arguments, ensure_ascii=False)}}``; invalid
  JSON leaves the text as content.
* Errors: ``{"object": "error", "message", "type", "param", "code"}`` at the top level (not wrapped
  in ``"error"`` as vLLM and OpenAI do): ``BadRequest`` for a refused request, ``Bad Request`` for one
  that fails validation.

Not reproduced (and not needed by the proxy, which calls SGLang non-streaming): chat *streaming*. The
reference server answers ``stream: true`` without token flags with a 400 that says so.
``reasoning_tokens`` and the first ``input_token_logprobs`` entry are best guesses (see docs).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from polar_mitm.output_parsers.qwen3 import StreamParser
from polar_mitm.tokens.conversation import RequestError, sglang_render_input, sglang_tool_choice

from .generation import Sample
from .wire import ChatCall, ReplyPlan, WireError

JSON_CONTENT_TYPE = "application/json"
THINK_START, THINK_END, TOOL_START = "<think>", "</think>", "<tool_call>"
_TOOL_REGION = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The flags SGLang refuses together with stream=true, and the message it gives for each.
_NO_STREAM_FLAGS = {
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming. "
    "Please set stream=false when using return_prompt_token_ids=true.",
    "return_meta_info": "return_meta_info is not supported with streaming. "
    "Please set stream=false when using return_meta_info=true.",
    "return_token_ids": "return_token_ids is not supported with streaming on /v1/chat/completions. "
    "Please set stream=false when using return_token_ids=true.",
}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def split_reasoning(text: str, force_reasoning: bool) -> tuple[str, str]:
    """SGLang's ``BaseReasoningFormatDetector.detect_and_parse`` for Qwen3: (reasoning, normal)."""
    if not (force_reasoning or THINK_START in text):
        return "", text
    while text.startswith(THINK_START):
        text = text[len(THINK_START) :]
    if THINK_END not in text:
        if TOOL_START in text:
            i = text.find(TOOL_START)
            return text[:i], text[i:]
        return text, ""
    reasoning, _, normal = text.partition(THINK_END)
    return reasoning, normal


def parse_tool_calls(
    text: str, tool_names: list[str]
) -> tuple[str, list[tuple[int, str, str]]] | None:
    """The qwen25 detector's non-streaming parse: (content, [(tool index, name, arguments)]),
    or ``None`` when the text holds no parsable tool call (SGLang keeps it as content)."""
    if TOOL_START not in text:
        return None
    try:
        calls = []
        for raw in _TOOL_REGION.findall(text):
            obj = json.loads(raw)
            name = obj["name"]
            if name not in tool_names:
                continue  # SGLang drops calls to undefined functions
            arguments = obj.get("parameters", obj.get("arguments", {}))
            calls.append((tool_names.index(name), name, json.dumps(arguments, ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return None
    return text[: text.find(TOOL_START)].strip(), calls


class SglangWire:
    """The SGLang wire kind (see the module docstring)."""

    kind = "sglang"
    flavor = "sglang"  # how the conversation is normalized before the template

    def __init__(self, *, reasoning_field: str = "reasoning", chunk_tokens: int = 1):
        # SGLang always names the field reasoning_content; the vLLM-only knobs are accepted and unused.
        self.chunk_tokens = chunk_tokens

    # -- errors ------------------------------------------------------------------------------

    def error(
        self, status: int, message: str, err_type: str, param: str | None = None
    ) -> dict[str, Any]:
        return {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": param,
            "code": status,
        }

    def _bad_request(self, message: str, param: str | None = None) -> WireError:
        return WireError(400, self.error(400, message, "BadRequest", param))

    def _invalid(self, message: str) -> WireError:
        """A body that fails pydantic validation (SGLang turns FastAPI's 422 into a 400)."""
        return WireError(400, self.error(400, message, "Bad Request"))

    def invalid_json(self, raw: bytes) -> WireError | None:
        try:
            json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._invalid(
                f"[{{'type': 'json_invalid', 'msg': 'JSON decode error', 'error': {str(e)!r}}}]"
            )
        return None

    # -- requests ----------------------------------------------------------------------------

    def parse_chat(self, body: Any, served_model: str) -> ChatCall:
        if not isinstance(body, Mapping):
            raise self._invalid(
                "Input should be a valid dictionary or object to extract fields from"
            )
        if "messages" not in body:
            raise self._invalid(
                "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required'}]"
            )
        stream = bool(body.get("stream") or False)
        if stream:
            for flag, message in _NO_STREAM_FLAGS.items():
                if body.get(flag):
                    raise self._bad_request(message)
        stream_options = body.get("stream_options")
        if body.get("n") not in (None, 1):
            raise self._bad_request("n > 1 is not supported by the reference policy server.", "n")
        logprobs = bool(body.get("logprobs") or False)
        top_logprobs = body.get("top_logprobs") or 0
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise self._invalid("top_logprobs must be a non-negative integer")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
        ):
            raise self._invalid("max_tokens must be an integer")
        tool_choice = sglang_tool_choice(body)
        if tool_choice == "required" and not body.get("tools"):
            raise self._bad_request("Tools cannot be empty if tool choice is set to required.")
        try:
            render = sglang_render_input(body)
        except RequestError as e:
            raise self._bad_request(str(e), e.param) from None
        return ChatCall(
            body=dict(body),
            render=render,
            model=body.get("model"),
            stream=stream,
            include_usage=bool(
                stream
                and isinstance(stream_options, Mapping)
                and stream_options.get("include_usage")
            ),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            return_token_ids=bool(body.get("return_token_ids") or False),
            max_tokens=max_tokens,
            tool_choice=tool_choice,
            parse_tools=bool(render.tools),
            thinking_enabled=render.kwargs.get("enable_thinking", True) is not False,
        )

    # -- replies -----------------------------------------------------------------------------

    def _finish_info(self, sample: Sample) -> dict[str, Any]:
        """The engine's ``meta_info.finish_reason`` (``schedule_batch.py`` ``FINISH_*.to_json``)."""
        finish = sample.finish_override or sample.finish_reason
        finish_info: dict[str, Any] = {"type": finish}
        if finish == "stop" and sample.ids:
            finish_info["matched"] = sample.ids[-1]
        elif finish == "length":
            finish_info["length"] = len(sample.ids)
        elif finish == "abort":  # a graceful abort (no status_code): HTTP 200, reason "abort"
            finish_info.update(message="Aborted", status_code=None, err_type=None)
        return finish_info

    def _sglext(self, call: ChatCall, sample: Sample) -> dict[str, Any] | None:
        """``sglext`` ids, when asked (``return_{input,output}_ids_in_sglext``)."""
        ext: dict[str, Any] = {}
        if call.body.get("return_input_ids_in_sglext"):
            ext["input_ids"] = list(sample.prompt_ids)
        if call.body.get("return_output_ids_in_sglext"):
            ext["output_ids"] = [list(sample.ids)]
        return ext or None

    def chat_reply(self, call: ChatCall, sample: Sample, served_model: str) -> ReplyPlan:
        if call.stream:
            return self._stream(call, sample)
        rid = uuid.uuid4().hex
        force_reasoning = call.thinking_enabled and sample.reasoning_open is not False
        reasoning, text = split_reasoning(sample.text, force_reasoning)
        finish_info = self._finish_info(sample)
        tool_calls = None
        parsed = None
        if call.parse_tools:
            names = [t["function"]["name"] for t in call.render.tools or ()]
            parsed = parse_tool_calls(text, names)
        if parsed is not None:
            text, calls = parsed
            if finish_info["type"] == "stop":
                finish_info["type"], finish_info["matched"] = "tool_calls", None
            tool_calls = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "index": ordinal,  # the call's ordinal (serving_chat.py _process_tool_calls)
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for ordinal, (_tool, name, arguments) in enumerate(calls)
            ]
        meta = self._meta_info(call, sample, rid, finish_info, reasoning)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text or "",
                "reasoning_content": reasoning or None,
                "tool_calls": tool_calls,
            },
            "logprobs": {"content": self._logprob_entries(call, sample)} if call.logprobs else None,
            "finish_reason": finish_info["type"],
            "matched_stop": finish_info.get("matched"),
        }
        body = call.body
        if body.get("return_prompt_token_ids") or call.return_token_ids:
            choice["prompt_token_ids"] = list(sample.prompt_ids)
        if call.return_token_ids:
            choice["response_token_ids"] = list(sample.ids)
        if body.get("return_meta_info"):
            choice["meta_info"] = meta
        p, c = len(sample.prompt_ids), len(sample.ids)
        reply = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model or "default",
            "choices": [choice],
            "usage": {
                "prompt_tokens": p,
                "total_tokens": p + c,
                "completion_tokens": c,
                "prompt_tokens_details": None,
                "reasoning_tokens": meta["reasoning_tokens"],
            },
            "metadata": {"weight_version": "default"},
        }
        ext = self._sglext(call, sample)
        if ext is not None:
            reply["sglext"] = ext
        return ReplyPlan(
            status=200,
            content_type=JSON_CONTENT_TYPE,
            events=[_dumps(reply)],
            tokens=[c],
            stream=False,
        )

    def _stream(self, call: ChatCall, sample: Sample) -> ReplyPlan:
        """SGLang's chat stream (``serving_chat.py`` ``_generate_chat_stream``, ``sse_utils.py``):
        a role chunk, one chunk per ``chunk_tokens`` tokens (``reasoning_content`` always
        present, ``null`` or text), tool-call deltas as ``ChatCompletionStreamResponse``, the
        finish chunk, then with sglext flags one ``choices: []`` chunk with the ids, the usage
        chunk (``include_usage``) and ``[DONE]``."""
        rid = uuid.uuid4().hex
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": call.model or "default",
        }
        events: list[bytes] = []
        tokens: list[int] = []

        def emit(choices: list[dict[str, Any]], n: int, **extra: Any) -> None:
            events.append(b"data: " + _dumps({**head, "choices": choices, **extra}) + b"\n\n")
            tokens.append(n)

        def choice(delta: dict[str, Any], logprobs: Any = None, **finish: Any) -> dict[str, Any]:
            return {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish.get("finish_reason"),
                "matched_stop": finish.get("matched_stop"),
            }

        emit([choice({"reasoning_content": None, "role": "assistant", "content": ""})], 0)
        parser = StreamParser(
            think_start_id=sample.think_ids[0],
            think_end_id=sample.think_ids[1],
            parse_tools=call.parse_tools,
            reasoning_open=sample.reasoning_open,
        )
        entries = self._logprob_entries(call, sample) if call.logprobs else None
        k, n, pending = max(self.chunk_tokens, 1), len(sample.ids), 0
        for a in range(0, n, k):
            b = min(a + k, n)
            pending += b - a
            delta = parser.feed("".join(sample.pieces[a:b]), sample.ids[a:b]) or {}
            logprobs = {"content": entries[a:b]} if entries is not None else None
            # One step's text as SGLang sends it (serving_chat.py _generate_stream_content):
            # its reasoning in a chunk with the step's logprobs; then, with tools (the tool-call
            # parser's path), its text and each tool-call item in chunks of their own, as
            # DeltaMessages without logprobs; without tools its text with the logprobs; and
            # logprobs no chunk took flushed in an empty delta. A step of several tokens can
            # so give several chunks.
            steps: list[tuple[dict[str, Any], Any, dict[str, Any]]] = []
            if delta.get("reasoning"):
                steps.append(({"reasoning_content": delta["reasoning"]}, logprobs, {}))
                logprobs = None
            if call.parse_tools:
                shaped = {"role": None, "content": None, "reasoning_content": None}
                if delta.get("content"):
                    text = {**shaped, "content": delta["content"], "tool_calls": None}
                    steps.append((text, None, {"usage": None}))
                for item in delta.get("tool_calls") or ():
                    steps.append(({**shaped, "tool_calls": [item]}, None, {"usage": None}))
            elif delta.get("content"):
                steps.append(
                    ({"reasoning_content": None, "content": delta["content"]}, logprobs, {})
                )
                logprobs = None
            if logprobs is not None:
                steps.append(({"reasoning_content": None}, logprobs, {}))
            for part, lps, extra in steps:
                emit([choice(part, lps)], pending, **extra)
                pending = 0
        info = self._finish_info(sample)
        finish = info["type"]
        if finish == "stop" and parser.tools_streamed:
            finish, info["matched"] = "tool_calls", None
        final = choice(
            {"reasoning_content": None}, finish_reason=finish, matched_stop=info.get("matched")
        )
        final_index = len(events)
        emit([final], pending)
        ext = self._sglext(call, sample)
        if ext is not None:
            emit([], 0, usage=None, sglext=ext)
        if call.include_usage:
            p, c = len(sample.prompt_ids), len(sample.ids)
            usage = {
                "prompt_tokens": p,
                "total_tokens": p + c,
                "completion_tokens": c,
                "prompt_tokens_details": None,
                "reasoning_tokens": self._reasoning_tokens(sample),
            }
            emit([], 0, usage=usage)
        events.append(b"data: [DONE]\n\n")
        tokens.append(0)
        return ReplyPlan(
            status=200,
            content_type="text/event-stream; charset=utf-8",
            events=events,
            tokens=tokens,
            stream=True,
            final_index=final_index,
        )

    def _reasoning_tokens(self, sample: Sample) -> int:
        think_end = sample.think_ids[1]
        return sample.ids.index(think_end) + 1 if think_end in sample.ids else 0

    def _logprob_entries(self, call: ChatCall, sample: Sample) -> list[dict[str, Any]]:
        entries = []
        for token, lp in zip(sample.token_strs, sample.logprobs, strict=True):
            entry: dict[str, Any] = {
                "token": token,
                "bytes": list(token.encode("utf-8")),
                "logprob": lp,
            }
            top = [dict(entry)] if call.top_logprobs else []
            entry["top_logprobs"] = top
            entries.append(entry)
        return entries

    def _meta_info(
        self, call: ChatCall, sample: Sample, rid: str, finish: dict[str, Any], reasoning: str
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(sample.prompt_ids),
            "weight_version": "default",
            "num_retractions": 0,
        }
        if call.logprobs:
            last = sample.prompt_ids[-1] if sample.prompt_ids else None
            meta["input_token_logprobs"] = [[None, last, None]] if last is not None else []
            meta["output_token_logprobs"] = [
                [lp, tid, text]
                for lp, tid, text in zip(
                    sample.logprobs, sample.ids, sample.token_strs, strict=True
                )
            ]
            meta["output_token_logprobs_length"] = len(sample.ids)
            if call.top_logprobs:
                meta["input_top_logprobs"] = [None]
                meta["output_top_logprobs"] = [[row] for row in meta["output_token_logprobs"]]
        think_end = sample.think_ids[1]
        n_reasoning = 0
        if reasoning and think_end in sample.ids:
            n_reasoning = sample.ids.index(think_end) + 1
        meta["reasoning_tokens"] = n_reasoning
        meta["completion_tokens"] = len(sample.ids)
        meta["cached_tokens"] = 0
        meta["e2e_latency"] = 0.001
        return meta

    # -- other endpoints ---------------------------------------------------------------------

    def models(self, served_model: str, root: str, max_model_len: int) -> dict[str, Any]:
        card = {
            "id": served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    def tokenize(
        self, ids: list[int], max_model_len: int, token_strs: list[str] | None
    ) -> dict[str, Any]:
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
