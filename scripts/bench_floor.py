"""The floor for any addon, for scripts/bench.py: plain mitmdump plus the least an LLM proxy
must do — send api.openai.com to the policy server — and, with BENCH_STREAM=1, stream the
reply (`flow.response.stream = True`). Without it, mitmdump's default: buffer, then replay.

(map_remote + stream_large_bodies cannot be the floor: with request streaming on, the server
connection opens at requestheaders time, before map_remote rewrites the URL in `request`.)
"""

import os
from urllib.parse import urlsplit

from mitmproxy import http

_UP = urlsplit(os.environ["BENCH_UPSTREAM"])
_STREAM = os.environ.get("BENCH_STREAM") == "1"


def requestheaders(flow: http.HTTPFlow) -> None:
    if flow.request.host == "api.openai.com":
        flow.request.scheme = "http"
        flow.request.host = _UP.hostname
        flow.request.port = _UP.port


def responseheaders(flow: http.HTTPFlow) -> None:
    if _STREAM:
        flow.response.stream = True
