"""A tiny stand-alone mitmproxy script that records what a harness really sends, and answers it.

    mitmdump -s tests/e2e/wire_capture.py --set wire_log=out.jsonl --set wire_plan=plan.json

It is the tool behind docs/harness-wire-notes.md and tests/fixtures/harness/: independent of the
polar-mitm addon on purpose, so what it records is the harness's own behaviour and not our
dialect code's. Every request (CONNECT too) becomes one JSON line: method, host, path, headers
with credentials redacted, the body (parsed JSON when it is JSON). LLM endpoints get a scripted,
minimal but well-formed reply in the harness's own dialect (Responses SSE, Messages SSE, chat
SSE, Google generateContent); a WebSocket upgrade gets 426; everything else a JSON 404, as
polar_other_paths=answer does.

The plan (JSON) says what each LLM turn answers, per dialect:

    {"responses": [{"custom": {"name": "exec", "input": "..."}}, {"text": "done"}],
     "messages":  [{"tool": {"name": "Bash", "arguments": {"command": "..."}}}, {"text": "done"}],
     "chat":      [{"tool": {"name": "bash", "arguments": {"command": "..."}}}, {"text": "done"}],
     "gemini":    [{"tool": {"name": "run_shell_command", "arguments": {...}}}, {"text": "done"}]}

The turn index is the number of tool results already in the request; a request without tools
(a side call: titles, summaries) gets {"text": "ok"}, or the plan's `"<dialect>_side"` turn when
it has one (Gemini CLI's model router wants JSON).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mitmproxy import ctx, http

SECRET_HEADERS = {
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "chatgpt-account-id",
    "x-goog-api-key",
}


# Google's API takes its key as a query parameter too (`?key=...`).
_KEY_PARAM = re.compile(r"([?&]key=)[^&]*")


def _redact(headers: http.Headers) -> list[list[str]]:
    out = []
    for name, value in headers.items(multi=True):
        if name.lower() in SECRET_HEADERS or name.lower().endswith("api-key"):
            polar = value.startswith(("Bearer polar-", "polar-"))
            value = "[redacted polar- key]" if polar else "[redacted]"
        out.append([name, value])
    return out


def _body(raw: bytes | None) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {"_raw": raw[:20000].decode("utf-8", "replace")}


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data) + "\n\n").encode()


def _tool_results(dialect: str, body: dict[str, Any]) -> int:
    if dialect == "responses":
        items = body.get("input") or []
        kinds = ("function_call_output", "custom_tool_call_output")
        return sum(1 for i in items if isinstance(i, dict) and i.get("type") in kinds)
    if dialect == "messages":
        n = 0
        for m in body.get("messages") or []:
            if m.get("role") == "user" and isinstance(m.get("content"), list):
                n += sum(
                    1
                    for b in m["content"]
                    if isinstance(b, dict) and b.get("type") == "tool_result"
                )
        return n
    if dialect == "gemini":
        return sum(
            1
            for c in body.get("contents") or []
            for p in (c.get("parts") or [] if isinstance(c, dict) else [])
            if isinstance(p, dict) and "functionResponse" in p
        )
    return sum(1 for m in body.get("messages") or [] if m.get("role") == "tool")


def _has_tools(dialect: str, body: dict[str, Any]) -> bool:
    if body.get("tools"):
        return True
    if dialect == "responses":
        return any(
            isinstance(i, dict) and i.get("type") == "additional_tools"
            for i in body.get("input") or []
        )
    return False


class WireCapture:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0

    def load(self, loader) -> None:
        loader.add_option(
            "wire_log", str, "wire.jsonl", "Where each request is appended as a JSON line."
        )
        loader.add_option("wire_plan", str, "", "JSON file: the scripted LLM turns per dialect.")
        loader.add_option(
            "wire_answer",
            bool,
            True,
            "Answer requests (the recorder). Off: only log them, each with the status it finally "
            "got, and leave answering to the addons loaded after this script (the e2e tests).",
        )

    def _plan(self, dialect: str) -> list[dict[str, Any]]:
        if not ctx.options.wire_plan:
            return []
        return json.loads(Path(ctx.options.wire_plan).read_text()).get(dialect, [])

    def _log(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.seq += 1
            entry = {"seq": self.seq, "t": round(time.time(), 3), **entry}
            with open(ctx.options.wire_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._log(
            {
                "kind": "connect",
                "method": "CONNECT",
                "host": flow.request.host,
                "port": flow.request.port,
                "headers": _redact(flow.request.headers),
            }
        )

    def request(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        body = _body(req.get_content(strict=False))
        path = req.path.partition("?")[0]
        entry = {
            "kind": "request",
            "method": req.method,
            "scheme": req.scheme,
            "host": req.host,
            "port": req.port,
            "path": _KEY_PARAM.sub(r"\1[redacted]", req.path),
            "http_version": req.http_version,
            "headers": _redact(req.headers),
            "body": body,
        }
        if not ctx.options.wire_answer:
            # Logged once the flow ends, with the status the next addons gave it.
            with self.lock:
                self.seq += 1
                entry["order"] = self.seq
            flow.metadata["wire_entry"] = entry
            return
        websocket = req.headers.get("upgrade", "").lower() == "websocket"
        dialect = None
        if websocket:
            flow.response = http.Response.make(
                426,
                json.dumps(
                    {"error": {"message": "no websocket here", "type": "invalid_request_error"}}
                ),
                {"content-type": "application/json"},
            )
        elif req.method == "POST" and path.endswith("/responses"):
            dialect = "responses"
        elif req.method == "POST" and path.endswith("/messages/count_tokens"):
            flow.response = http.Response.make(
                200, json.dumps({"input_tokens": 42}), {"content-type": "application/json"}
            )
        elif req.method == "POST" and path.endswith("/messages"):
            dialect = "messages"
        elif req.method == "POST" and path.endswith("/chat/completions"):
            dialect = "chat"
        elif req.method == "POST" and path.endswith(":countTokens"):
            flow.response = http.Response.make(
                200, json.dumps({"totalTokens": 42}), {"content-type": "application/json"}
            )
        elif req.method == "POST" and path.endswith(("GenerateContent", ":generateContent")):
            dialect = "gemini"
        else:
            flow.response = http.Response.make(
                404,
                json.dumps(
                    {
                        "error": {
                            "message": f"wire_capture: {req.method} {path} not served",
                            "type": "not_found_error",
                        }
                    }
                ),
                {"content-type": "application/json"},
            )
        if dialect is not None and isinstance(body, dict):
            turn_no = _tool_results(dialect, body)
            plan = self._plan(dialect)
            if not _has_tools(dialect, body):
                turn = (self._plan(dialect + "_side") or [{"text": "ok"}])[0]
            elif turn_no < len(plan):
                turn = plan[turn_no]
            else:
                turn = {"text": "The scripted conversation has ended."}
            entry["answered"] = turn
            stream = bool(body.get("stream")) or path.endswith(":streamGenerateContent")
            model = body.get("model") or path.rpartition("/")[2].partition(":")[0] or "m"
            flow.response = getattr(self, "_" + dialect)(turn, stream, model)
        entry["status"] = flow.response.status_code if flow.response else None
        self._log(entry)

    def response(self, flow: http.HTTPFlow) -> None:
        entry = flow.metadata.pop("wire_entry", None)
        if entry is not None:
            entry["status"] = flow.response.status_code if flow.response else None
            self._log(entry)

    def error(self, flow: http.HTTPFlow) -> None:
        entry = flow.metadata.pop("wire_entry", None)
        if entry is not None:
            entry["status"] = flow.response.status_code if flow.response else None
            entry["error"] = flow.error.msg if flow.error else "error"
            self._log(entry)

    # -- replies --------------------------------------------------------------------------------

    def _responses(self, turn: dict[str, Any], stream: bool, model: str) -> http.Response:
        rid = "resp_" + uuid.uuid4().hex[:16]
        iid = uuid.uuid4().hex[:16]
        if "custom" in turn:
            item = {
                "id": "ctc_" + iid,
                "type": "custom_tool_call",
                "status": "completed",
                "call_id": "call_" + iid,
                "name": turn["custom"]["name"],
                "input": turn["custom"]["input"],
            }
        elif "tool" in turn:
            item = {
                "id": "fc_" + iid,
                "type": "function_call",
                "status": "completed",
                "call_id": "call_" + iid,
                "name": turn["tool"]["name"],
                "arguments": json.dumps(turn["tool"]["arguments"]),
            }
        else:
            item = {
                "id": "msg_" + iid,
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": turn["text"], "annotations": []}],
            }
        usage = {
            "input_tokens": 100,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 10,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 110,
        }
        resp = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "status": "completed",
            "output": [item],
            "usage": usage,
        }
        if not stream:
            return http.Response.make(200, json.dumps(resp), {"content-type": "application/json"})
        started = {**resp, "status": "in_progress", "output": [], "usage": None}
        events = [
            _sse(
                "response.created",
                {"type": "response.created", "sequence_number": 0, "response": started},
            )
        ]
        added = {**item, "status": "in_progress"}
        if item["type"] == "message":
            added["content"] = []
        elif item["type"] == "custom_tool_call":
            added["input"] = ""
        else:
            added["arguments"] = ""
        events.append(
            _sse(
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": 0, "item": added},
            )
        )
        if item["type"] == "message":
            text = turn["text"]
            events.append(
                _sse(
                    "response.content_part.added",
                    {
                        "type": "response.content_part.added",
                        "item_id": item["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []},
                    },
                )
            )
            events.append(
                _sse(
                    "response.output_text.delta",
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "delta": text,
                    },
                )
            )
            events.append(
                _sse(
                    "response.output_text.done",
                    {
                        "type": "response.output_text.done",
                        "item_id": item["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "text": text,
                    },
                )
            )
            events.append(
                _sse(
                    "response.content_part.done",
                    {
                        "type": "response.content_part.done",
                        "item_id": item["id"],
                        "output_index": 0,
                        "content_index": 0,
                        "part": item["content"][0],
                    },
                )
            )
        elif item["type"] == "custom_tool_call":
            events.append(
                _sse(
                    "response.custom_tool_call_input.delta",
                    {
                        "type": "response.custom_tool_call_input.delta",
                        "item_id": item["id"],
                        "output_index": 0,
                        "delta": item["input"],
                    },
                )
            )
            events.append(
                _sse(
                    "response.custom_tool_call_input.done",
                    {
                        "type": "response.custom_tool_call_input.done",
                        "item_id": item["id"],
                        "output_index": 0,
                        "input": item["input"],
                    },
                )
            )
        else:
            events.append(
                _sse(
                    "response.function_call_arguments.delta",
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
                        "output_index": 0,
                        "delta": item["arguments"],
                    },
                )
            )
            events.append(
                _sse(
                    "response.function_call_arguments.done",
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item["id"],
                        "output_index": 0,
                        "arguments": item["arguments"],
                    },
                )
            )
        events.append(
            _sse(
                "response.output_item.done",
                {"type": "response.output_item.done", "output_index": 0, "item": item},
            )
        )
        events.append(_sse("response.completed", {"type": "response.completed", "response": resp}))
        return http.Response.make(200, b"".join(events), {"content-type": "text/event-stream"})

    def _messages(self, turn: dict[str, Any], stream: bool, model: str) -> http.Response:
        mid = "msg_" + uuid.uuid4().hex[:20]
        if "tool" in turn:
            block = {
                "type": "tool_use",
                "id": "toolu_" + uuid.uuid4().hex[:20],
                "name": turn["tool"]["name"],
                "input": turn["tool"]["arguments"],
            }
            stop = "tool_use"
        else:
            block = {"type": "text", "text": turn["text"]}
            stop = "end_turn"
        usage = {
            "input_tokens": 100,
            "output_tokens": 10,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        msg = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [block],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not stream:
            return http.Response.make(200, json.dumps(msg), {"content-type": "application/json"})
        events = [
            _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        **msg,
                        "content": [],
                        "stop_reason": None,
                        "usage": {**usage, "output_tokens": 1},
                    },
                },
            )
        ]
        if block["type"] == "text":
            events.append(
                _sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            events.append(_sse("ping", {"type": "ping"}))
            events.append(
                _sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": block["text"]},
                    },
                )
            )
        else:
            events.append(
                _sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {**block, "input": {}},
                    },
                )
            )
            events.append(
                _sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"]),
                        },
                    },
                )
            )
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        events.append(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 10},
                },
            )
        )
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return http.Response.make(200, b"".join(events), {"content-type": "text/event-stream"})

    def _chat(self, turn: dict[str, Any], stream: bool, model: str) -> http.Response:
        cid = "chatcmpl-" + uuid.uuid4().hex[:20]
        base = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        if "tool" in turn:
            call = {
                "index": 0,
                "id": "call_" + uuid.uuid4().hex[:20],
                "type": "function",
                "function": {
                    "name": turn["tool"]["name"],
                    "arguments": json.dumps(turn["tool"]["arguments"]),
                },
            }
            delta, finish = (
                {"role": "assistant", "content": None, "tool_calls": [call]},
                "tool_calls",
            )
        else:
            delta, finish = {"role": "assistant", "content": turn["text"]}, "stop"
        usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
        if not stream:
            message = {k: v for k, v in delta.items()}
            if "tool_calls" in message:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in message["tool_calls"]
                ]
            body = {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            }
            return http.Response.make(200, json.dumps(body), {"content-type": "application/json"})
        events = [
            _sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
            _sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
            _sse(None, {**base, "choices": [], "usage": usage}),
        ]
        return http.Response.make(
            200, b"".join(events) + b"data: [DONE]\n\n", {"content-type": "text/event-stream"}
        )

    def _gemini(self, turn: dict[str, Any], stream: bool, model: str) -> http.Response:
        """Google `generateContent`: one GenerateContentResponse, or (`?alt=sse`) one per event."""
        if "tool" in turn:
            part = {
                "functionCall": {"name": turn["tool"]["name"], "args": turn["tool"]["arguments"]}
            }
        else:
            part = {"text": turn["text"]}
        usage = {"promptTokenCount": 100, "candidatesTokenCount": 10, "totalTokenCount": 110}
        reply = {
            "candidates": [
                {"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}
            ],
            "usageMetadata": usage,
            "modelVersion": model,
            "responseId": uuid.uuid4().hex[:20],
        }
        if not stream:
            return http.Response.make(200, json.dumps(reply), {"content-type": "application/json"})
        return http.Response.make(
            200,
            b"data: " + json.dumps(reply).encode() + b"\r\n\r\n",
            {"content-type": "text/event-stream"},
        )


addons = [WireCapture()]
