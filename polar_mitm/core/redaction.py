"""The redaction that keeps secrets off disk: credential headers dropped, credential-named JSON
keys blanked, and the request's own credential values scrubbed wherever else they appear.

Shared by the capture path (headers, request bodies) and the exchange (the reply it stores),
below both, so a stored body never depends on which of them wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from . import fastjson

# The headers an API key comes in (`authorization` as `Bearer <key>`), first found first used.
KEY_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
REDACTED = "[redacted]"
# Headers whose values are credentials. Values are dropped, never hashed or truncated.
SECRET_HEADERS = frozenset(
    {
        *KEY_HEADERS,  # the API keys
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "openai-organization",
        "openai-project",
        "chatgpt-account-id",
        "x-polar-control-token",
    }
)
# JSON keys whose values are credentials wherever they appear in a stored body.
_SECRET_KEY = re.compile(
    r"^(api[_-]?key|authorization|password|passwd|secret|client[_-]?secret|access[_-]?token"
    r"|refresh[_-]?token|id[_-]?token|session[_-]?token|cookie|credentials?)$",
    re.IGNORECASE,
)
# Keys already seen not to be credential names (`has_secret_key`): a request repeats a few dozen
# ("role", "content", "type", ...), so each costs one set lookup instead of a regex match. Bounded:
# keys a harness makes up (a tool schema's property names) stop being added past the limit.
_PLAIN_KEYS: set[str] = set()
_PLAIN_KEYS_MAX = 4096


def redact_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        out[key] = REDACTED if key in SECRET_HEADERS else value
    return out


def secret_values(headers: Mapping[str, str]) -> list[str]:
    """The credential values of a request, to scrub wherever else they might appear."""
    values = []
    for name in SECRET_HEADERS:
        value = headers.get(name)
        if value:
            values.append(value)
            scheme, _, rest = value.partition(" ")
            if rest and scheme.lower() in ("bearer", "basic"):
                values.append(rest.strip())
    return [v for v in values if len(v) >= 6]


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON value with credential-named keys blanked."""
    if isinstance(obj, dict):
        return {
            k: (REDACTED if isinstance(k, str) and _SECRET_KEY.match(k) else redact_obj(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    return obj


def has_secret_key(obj: Any) -> bool:
    """Whether a credential-named key is anywhere in a JSON value (what `redact_obj` blanks).

    A walk over the keys, not a search of the JSON text: a long agent request is hundreds of KB
    of text but a few hundred keys, and the strings between them are skipped unread (a
    case-insensitive regex over the text was 1.3 ms of a 250 KB request, this walk is a tenth of
    that)."""
    stack = [obj]
    plain = _PLAIN_KEYS
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in plain and isinstance(k, str):
                    if _SECRET_KEY.match(k):
                        return True
                    if len(plain) < _PLAIN_KEYS_MAX:
                        plain.add(k)
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (dict, list)))
    return False


def redacted_json(obj: Any, secrets: Iterable[str] = (), text: str | None = None) -> str:
    """JSON of `obj` with credential-named keys blanked and `secrets` scrubbed: `text` as it
    came, where that is safe (below), else compact JSON written here.

    Requests run to hundreds of KB in long agent loops and almost never hold a credential key,
    so the tree is copied (`redact_obj`) only when `has_secret_key` finds one. `text`, the JSON
    `obj` was decoded from, is kept as it came when there is nothing to blank: re-encoding a
    250 KB request cost 0.21 ms of the event loop per call, decoding its bytes 0.01. Not when
    a secret could hide behind an escape there (``\\u0073k-...``, ``\\/``) that `scrub`'s search
    would miss: re-encoded, each such character is written as itself."""
    secrets = list(secrets)
    if has_secret_key(obj):
        text = fastjson.dumps(redact_obj(obj))
    elif text is None or (secrets and not _verbatim_safe(text, secrets)):
        text = fastjson.dumps(obj)
    return scrub(text, secrets)


# Characters no JSON encoder escapes (`/` is one some do): a secret made of them appears in the
# text of any encoding of a string holding it, unless the encoder escapes one of them at will
# (``\u0073``: an escape of printable ASCII, U+0020-U+007F). Escapes of other characters (an
# emoji's pair from an ASCII-only encoder such as Python's `json`, ``\u001b``) cannot spell a
# character of such a secret, so a text holding only those is kept as sent.
_UNESCAPED = re.compile(r"[A-Za-z0-9 ._~+=:-]*")
_ASCII_ESCAPE = re.compile(r"\\u00[2-7][0-9a-fA-F]")


def _verbatim_safe(text: str, secrets: list[str]) -> bool:
    if "\\u00" in text and _ASCII_ESCAPE.search(text):
        return False
    return all(_UNESCAPED.fullmatch(s) for s in secrets)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with each of `secrets` (in their order) replaced. A secret that holds a shorter one
    absent from the text is absent too, so a request without its key ("Bearer K", "K") costs one
    scan of its hundreds of KB, not one per value."""
    secrets = list(secrets)
    absent: list[str] = []
    for secret in sorted(set(secrets), key=len):
        if any(a in secret for a in absent) or secret not in text:
            absent.append(secret)
    for secret in secrets:
        if secret not in absent and secret in text:
            text = text.replace(secret, REDACTED)
    return text
