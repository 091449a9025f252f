"""JSON on the hot path: msgspec where it gives the same value, the stdlib where it does not.

In a long agent session the first upstream chunk carries the whole prompt's ids (100k ints) and
the request is hundreds of KB; decoding and re-encoding them with the stdlib `json` was the
largest part of polar-mitm's own CPU per call under scripts/bench.py --long (the profile in
README "Performance"). msgspec decodes an id list about twice as fast and encodes a request
several times faster. (orjson was measured too: as fast, but it turns an integer beyond 64 bits
into a float without an error, so a value would silently change.)

Behaviour stays the stdlib's: whatever msgspec refuses and `json` accepts (NaN and Infinity,
numbers beyond a float's range, lone surrogate escapes, very deep nesting) is decoded by `json`,
so the callers' checks and error messages are unchanged; an object msgspec cannot encode (a lone
surrogate, a key that is not a string) is encoded by `json`. One difference remains: msgspec
writes a float NaN or Infinity as null (the stdlib writes NaN, which is not JSON); such a value
only exists when the harness or the upstream sent one.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
# One stdlib encoder (json.dumps with arguments builds a new JSONEncoder per call).
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def loads(data: str | bytes) -> Any:
    """`json.loads(data)`, by msgspec when it accepts the text."""
    try:
        return _DECODER.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(data)


def dumps_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON (non-ASCII kept as is), by msgspec when it can encode `obj`."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, UnicodeEncodeError, RecursionError, msgspec.MsgspecError):
        return json.dumps(obj, separators=(",", ":")).encode()  # ASCII: lone surrogates escaped


def dumps(obj: Any) -> str:
    """Compact JSON text (non-ASCII kept as is), by msgspec when it can encode `obj`."""
    try:
        return _ENCODER.encode(obj).decode("utf-8")
    except (TypeError, UnicodeEncodeError, RecursionError, msgspec.MsgspecError):
        return _COMPACT.encode(obj)
