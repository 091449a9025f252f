"""A policy server that breaks mid-stream: a few vLLM-shaped chunks, then the connection closes.

The reference server has no fault modes yet; this stand-in is enough to show that a harness's
stream ends with its dialect's error event when the upstream goes away mid-reply.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "Qwen/Qwen3-4B"


def _chunk(delta: dict, **extra: object) -> bytes:
    body = {
        "id": "chatcmpl-broken",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
                "token_ids": extra.pop("token_ids", []),
            }
        ],
        **extra,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(_chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3]))
        self.wfile.write(_chunk({"content": "half a"}, token_ids=[10, 11]))
        self.wfile.write(_chunk({"content": " reply"}, token_ids=[12]))
        self.wfile.flush()
        self.close_connection = True


class BrokenUpstream:
    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
