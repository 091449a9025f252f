"""The floors for any addon, for scripts/bench.py: plain mitmdump plus the least an LLM proxy
must do — send api.openai.com to the policy server — and, with BENCH_STREAM=1, stream the
reply (`flow.response.stream = True`). Without it, mitmdump's default: buffer, then replay.

With BENCH_CAPTURE=1 as well, the least a *token-capturing* addon must do on top: ask the server
for token ids and logprobs (so every chunk carries them) and JSON-decode each streamed event to
read them. The chunks go on to the client unchanged (no translation, no stripping, nothing
written): whatever polar-mitm costs above this column is its own work, not the price of capture.
The request's rewrite and every event are decoded with msgspec, the fastest JSON decoder in reach
and the one polar-mitm uses (`polar_mitm/core/fastjson.py`): a floor the stdlib's `json` would raise
(it decodes a 60k-id first chunk about twice as slowly).

(map_remote + stream_large_bodies cannot be the floor: with request streaming on, the server
connection opens at requestheaders time, before map_remote rewrites the URL in `request`.)
"""

import os
from urllib.parse import urlsplit

import msgspec
from mitmproxy import http

_UP = urlsplit(os.environ["BENCH_UPSTREAM"])
_STREAM = os.environ.get("BENCH_STREAM") == "1"
_CAPTURE = os.environ.get("BENCH_CAPTURE") == "1"
_DECODE = msgspec.json.Decoder().decode
_ENCODE = msgspec.json.Encoder().encode


def requestheaders(flow: http.HTTPFlow) -> None:
    if flow.request.host == "api.openai.com":
        flow.request.scheme = "http"
        flow.request.host = _UP.hostname
        flow.request.port = _UP.port


def request(flow: http.HTTPFlow) -> None:
    if _CAPTURE and flow.request.path.startswith("/v1/chat/completions"):
        body = _DECODE(flow.request.content or b"{}")
        body.update(return_token_ids=True, logprobs=True, top_logprobs=0)
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        flow.request.content = _ENCODE(body)


class _ReadIds:
    """A `flow.response.stream` callable: splits the SSE stream into events, decodes each one
    and keeps its token ids; passes every byte through as it came. Linear in the stream: a
    long call's first event (the prompt's ids, hundreds of KB) arrives in many reads, and each
    read searches only the bytes not searched before."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.scan = 0
        self.ids: list[int] = []

    def __call__(self, data: bytes) -> bytes:
        buf = self.buffer
        buf += data
        start, end = 0, buf.find(b"\n\n", self.scan)
        while end >= 0:
            for line in bytes(buf[start:end]).split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = _DECODE(line[6:])
                    for choice in chunk.get("choices") or ():
                        self.ids.extend(choice.get("token_ids") or ())
            start, end = end + 2, buf.find(b"\n\n", end + 2)
        del buf[:start]
        self.scan = max(len(buf) - 1, 0)
        return data


def responseheaders(flow: http.HTTPFlow) -> None:
    if _CAPTURE and flow.response.headers.get("content-type", "").startswith("text/event-stream"):
        flow.response.stream = _ReadIds()
    elif _STREAM:
        flow.response.stream = True
