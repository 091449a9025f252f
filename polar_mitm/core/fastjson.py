"""JSON on the hot path: msgspec where it gives the same value, the stdlib where it does not.

In a long agent session the first upstream chunk carries the whole prompt's ids (100k ints) and
the request is hundreds of KB; decoding and re-encoding them with the stdlib `json` was the
largest part of polar-mitm's own CPU per call under python -m polar_bench long (the profile in
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
import warnings
from array import array
from typing import Any

import msgspec
import numpy as np

_DECODER = msgspec.json.Decoder()
_TOP_RAW = msgspec.json.Decoder(dict[str, msgspec.Raw])
_INT32 = (-(1 << 31), (1 << 31) - 1)
# Below this size an object is decoded whole: the ids' own path pays off on long prompts only.
IDS_MIN_CHARS = 8192
_ENCODER = msgspec.json.Encoder()
# One stdlib encoder (json.dumps with arguments builds a new JSONEncoder per call).
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def loads(data: str | bytes) -> Any:
    """`json.loads(data)`, by msgspec when it accepts the text."""
    return _loads(data)[0]


def decode(data: str, ids_key: str | None = None) -> tuple[Any, bool]:
    """The value of JSON text `data` (`loads`, or `loads_ids` with `ids_key`), and whether it
    holds a lone surrogate escape (`lone_surrogates`), which no store or tokenizer takes.

    msgspec refuses every one, decoding or skipping a value (a high surrogate not followed by a
    low one, a low one alone: `json_handle_unicode_escape` and the skip path in its `_core.c`,
    read at 0.18.0, the pin's floor, and tried at 0.23.0), so only a value the stdlib's `json`
    decoded is walked. Walking every request was 3 % of the event loop under the long load
    (py-spy --gil), where an ASCII-only encoder writes each emoji as an escaped pair."""
    value, by_stdlib = _loads_ids(data, ids_key) if ids_key else _loads(data)
    return value, by_stdlib and lone_surrogates(data, value)


def _loads(data: str | bytes) -> tuple[Any, bool]:
    try:
        return _DECODER.decode(data), False
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(data), True


def loads_ids(data: str | bytes, key: str = "prompt_token_ids") -> Any:
    """`loads(data)`, with a top-level `key` that holds a list of 32-bit integers given as an
    int32 `array` instead of a list.

    The first chunk of a long call's stream is almost all prompt ids (436 KB of JSON at 60k
    tokens); a list of 60k Python ints, then copied into the array the record keeps, cost twice
    what reading the digits straight into int32 costs (msgspec skims the value as raw text,
    numpy parses it: 1.7 against 3.2 ms at 60k ids). Anything else — the key nested, a value
    that is not a list of such integers, a document `loads` would refuse — is `loads`'s."""
    return _loads_ids(data, key)[0]


def _loads_ids(data: str | bytes, key: str) -> tuple[Any, bool]:
    if len(data) < IDS_MIN_CHARS:
        return _loads(data)
    marker = f'"{key}":' if isinstance(data, str) else f'"{key}":'.encode()
    if marker not in data:  # type: ignore[operator]
        return _loads(data)
    try:
        top = _TOP_RAW.decode(data)
        raw = top.get(key)
        ids = _int32_list(bytes(raw)) if raw is not None else None
        if ids is None:
            return _loads(data)
        out: dict[str, Any] = {k: (ids if k == key else _DECODER.decode(v)) for k, v in top.items()}
    except (msgspec.MsgspecError, RecursionError, ValueError):
        return _loads(data)
    return out, False  # msgspec read every key and value; the ids are digits


def lone_surrogates(text: str, value: Any) -> bool:
    """Whether `value`, decoded from the JSON `text`, holds a string UTF-8 cannot encode: a lone
    surrogate escape (``\\ud800``), which no store, tokenizer or server takes.

    A text without a surrogate escape is answered by substring searches (the common case, a
    stream chunk or request from a UTF-8 encoder; one memchr where it holds no backslash). With
    one (an emoji from an ASCII-only encoder is a pair of them) each string and key is encoded,
    walking the dicts and lists only: an int32 id array (`loads_ids`) holds no text. The walk
    costs a fifth of encoding the value whole (`polar_bench/surrogates.py`: 0.30 against 1.71
    ms for a 480 KB request with emoji)."""
    if "\\" not in text or ("\\ud" not in text and "\\uD" not in text):
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _int32_list(raw: bytes) -> array | None:
    """The int32 array of a JSON list of integers (None when it is not exactly one)."""
    raw = raw.strip()
    if not (raw.startswith(b"[") and raw.endswith(b"]")):
        return None
    inner = raw[1:-1]
    if not inner.strip():
        return array("i")
    if b"." in inner or b"e" in inner or b"E" in inner:  # floats: `loads` says what they are
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a value numpy cannot read raises, never truncates
        try:
            values = np.fromstring(inner, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None
    if len(values) != inner.count(b",") + 1:
        return None
    if values.min() < _INT32[0] or values.max() > _INT32[1]:  # beyond int32 (or int64 clamped)
        return None
    return array("i", values.astype(np.int32).tobytes())


def dumps_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON (non-ASCII kept as is), by msgspec when it can encode `obj`."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, UnicodeEncodeError, RecursionError, msgspec.MsgspecError):
        # ASCII: lone surrogates escaped; a `msgspec.Raw` (JSON text kept as is) read back
        return json.dumps(obj, separators=(",", ":"), default=_raw_value).encode()


def _raw_value(obj: Any) -> Any:
    if isinstance(obj, msgspec.Raw):
        return json.loads(bytes(obj))
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(obj: Any) -> str:
    """Compact JSON text (non-ASCII kept as is), by msgspec when it can encode `obj`."""
    try:
        return _ENCODER.encode(obj).decode("utf-8")
    except (TypeError, UnicodeEncodeError, RecursionError, msgspec.MsgspecError):
        return _COMPACT.encode(obj)
