"""How an upstream's failure reaches the harness: the error it is told, in its own dialect's shape.

Every way the policy server can fail a call — an HTTP error, an unreadable chunk or reply, a
connection that will not open or goes quiet or drops — becomes one `UpstreamFailed` with the
status, kind and message the harness gets (docs/faults.md). Kept apart from the exchange
(`exchange.py`), which only decides *when* a call failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import aiohttp

from ..core import fastjson

_ERROR_BODY_LIMIT = 64 << 10
# The refusals of an output cap that a resend without it answers (docs/upstreams.md, "Output cap"):
# vLLM 0.33 refuses a cap above the whole context (it clamps one that only does not fit beside the
# prompt); older vLLM and SGLang refuse prompt + cap > context.
_CAP_ABOVE_CONTEXT = re.compile(
    r"(max_tokens|max_completion_tokens)=\d+ cannot be greater than max_model_len"
)
_CAP_TOO_LARGE = re.compile(
    r"(?is)(max_tokens|max_completion_tokens|output tokens|in the completion|for the completion)"
    r".*maximum context length|maximum context length.*"
    r"(max_tokens|max_completion_tokens|output tokens|in the completion|for the completion)"
)
# A prompt that is too long by itself, which no resend can help: vLLM 0.33 ("... exceeds this limit
# even without any output tokens"), older vLLM ("your request has N input tokens. Please reduce
# ..."), SGLang ("The input (N tokens) is longer than the model's context length").
_PROMPT_TOO_LONG = re.compile(
    r"(?is)without any output tokens|your (?:prompt|request) (?:contains|has) (?:at least )?\d+ "
    r"input tokens\. Please reduce|The input \(\d+ tokens\) is longer than"
)
# What a malformed upstream chunk or reply raises in the token and translation code (a field of the
# wrong type, a missing key). Caught around each chunk, so the valid path pays nothing for it.
MALFORMED = (AttributeError, TypeError, KeyError, IndexError, ValueError)
# Upstream headers worth passing on with an error: a harness's SDK honours them when it retries.
_ERROR_HEADERS = ("retry-after", "retry-after-ms")


class UpstreamFailed(Exception):
    """The upstream did not give a usable reply; `status` is what the harness gets."""

    def __init__(
        self,
        message: str,
        status: int = 502,
        kind: str = "server_error",
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind
        self.headers = headers


def malformed(e: Exception, what: str = "a stream chunk") -> UpstreamFailed:
    """What the harness is told of an upstream chunk or reply our code could not read."""
    return UpstreamFailed(f"upstream sent {what} polar-mitm cannot read ({type(e).__name__}: {e})")


async def read_error(
    resp: aiohttp.ClientResponse, base_url: str, model_served: str | None
) -> UpstreamFailed:
    """An upstream's non-200 answer as the harness's error: its message, a status and kind the
    harness's SDK understands, and the retry headers it honours."""
    raw = await resp.content.read(_ERROR_BODY_LIMIT)
    detail = raw.decode("utf-8", "replace").strip()
    try:
        detail = error_message(json.loads(detail)) or detail
    except (RecursionError, ValueError):
        pass
    detail = clean(detail)
    message = f"upstream {base_url} returned HTTP {resp.status}" + (f": {detail}" if detail else "")
    if resp.status == 404:
        message += (
            f" (polar-mitm sent model {model_served!r}: polar_model, or the first "
            "model the server lists)"
        )
    kind = "invalid_request_error" if 400 <= resp.status < 500 else "server_error"
    if resp.status == 429:
        kind = "rate_limit_error"
    status = resp.status if 400 <= resp.status < 600 else 502
    headers = {h: resp.headers[h] for h in _ERROR_HEADERS if h in resp.headers} or None
    return UpstreamFailed(message, status, kind, headers)


def failure_of(
    e: Exception, base_url: str, connect_timeout: float, stall: str
) -> UpstreamFailed | None:
    """What the harness is told when talking to the upstream raised `e` (`stall`: the message of
    a read that timed out); None for an exception of no known kind (a bug of ours)."""
    if isinstance(e, UpstreamFailed):
        return e
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        msg = f"upstream {base_url} did not accept a connection within {connect_timeout:g}s"
        return UpstreamFailed(msg, 504)
    if isinstance(e, (TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamFailed(stall, 504)
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamFailed(f"upstream {base_url} is unreachable: {e.strerror or e}", 502)
    if isinstance(
        e,
        (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientOSError,
            ConnectionResetError,
        ),
    ):
        msg = (
            f"upstream {base_url} closed the connection before the reply was complete "
            f"({type(e).__name__}: {e})"
        )
        return UpstreamFailed(msg, 502)
    if isinstance(e, (aiohttp.ClientError, ConnectionError)):
        return UpstreamFailed(f"upstream {base_url} failed: {type(e).__name__}: {e}", 502)
    return None


def cap_refused(message: str) -> bool:
    """Whether an upstream 400's text refuses the output cap (and not the prompt's length)."""
    if _PROMPT_TOO_LONG.search(message):
        return False
    return bool(_CAP_ABOVE_CONTEXT.search(message) or _CAP_TOO_LARGE.search(message))


def json_value(data: str, what: str) -> Any:
    """Parse upstream JSON text; lone surrogate escapes (text no store can encode) are refused.
    A top-level ``prompt_token_ids`` (vLLM's) comes back as the int32 array the record keeps."""
    value, lone_surrogate = fastjson.decode(data, "prompt_token_ids")
    if lone_surrogate:
        raise ValueError(f"the {what} holds a lone surrogate escape: not valid Unicode")
    return value


def json_chunk(data: str) -> dict[str, Any]:
    try:
        chunk = json_value(data, "chunk")
    except (RecursionError, ValueError) as e:
        raise UpstreamFailed(f"upstream sent invalid JSON in a stream chunk: {e}") from None
    if not isinstance(chunk, dict):
        raise UpstreamFailed("upstream sent a stream chunk that is not a JSON object")
    return chunk


def clean(text: str) -> str:
    """Upstream text for an error message: valid UTF-8 (no lone surrogates), bounded."""
    return text[:2000].encode("utf-8", "replace").decode("utf-8")


def error_message(obj: Any) -> str | None:
    if isinstance(obj, dict):
        error = obj.get("error", obj)
        if isinstance(error, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(error.get(key), str):
                    return error[key]
        elif isinstance(error, str):
            return error
        if isinstance(obj.get("detail"), str):
            return obj["detail"]
    return None
