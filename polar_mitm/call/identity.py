"""Which rollout a call belongs to, without changing the harness.

Precedence (docs/design.md, "Rollout identity"):
1. proxy credentials in the proxy URL (`HTTPS_PROXY=http://<rollout>:<x>@proxy:8080`), which
   arrive as `Proxy-Authorization: Basic ...` on CONNECT and hold for the whole connection;
2. an API key of the form `polar-<rollout>` (`Authorization: Bearer ...`, `x-api-key`, or
   Google's `x-goog-api-key` header or `?key=` query parameter);
3. an `x-polar-rollout` header;
4. the client address plus the harness's session header (`session`), or, without one, the client
   address alone (`client_address`): an *anonymous* rollout, which merges every session from that
   address, so its traces are untrainable (`anonymous`) unless `polar_train_allow` allows it
   (one container per rollout) and the proxy warns once per address (addons/identity.py).
A rollout id `<group>.<sample>` (e.g. `django-11099.3`) names sample 3 of GRPO group `django-11099`.
Each call records which rule gave its id (`calls.rollout_source`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..core.redaction import KEY_HEADERS

API_KEY_PREFIX = "polar-"
ROLLOUT_HEADER = "x-polar-rollout"
KEY_PARAM = "key"  # Google's API takes its key as a query parameter too
# Where a rollout id came from (calls.rollout_source), in precedence order.
PROXY_AUTH, API_KEY, HEADER, SESSION, CLIENT_ADDRESS = (
    "proxy_auth",
    "api_key",
    "header",
    "session",
    "client_address",
)
# Session/conversation headers the harnesses send (Claude Code, Codex, OpenCode), most specific
# first.
SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "conversation-id",
    "conversation_id",
    "thread-id",
    "x-session-id",
    "x-session-affinity",
)
_VALID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,199}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]+")


@dataclass(frozen=True, slots=True)
class RolloutIdentity:
    rollout_id: str
    source: str  # proxy_auth | api_key | header | session | client_address
    group_id: str | None
    sample_index: int | None
    session_id: str | None


def split_group(rollout_id: str) -> tuple[str | None, int | None]:
    """`task.3` -> ("task", 3); an id without a numeric last part is its own group of one."""
    group, dot, sample = rollout_id.rpartition(".")
    if dot and group and sample.isdigit() and len(sample) <= 9:  # an int32 column
        return group, int(sample)
    return None, None


def valid_rollout_id(value: str) -> bool:
    return bool(_VALID.match(value))


def proxy_user(header_value: str | None) -> str | None:
    """The user name of a `Proxy-Authorization: Basic` header, or None."""
    if not header_value:
        return None
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user = decoded.partition(":")[0]
    return user or None


def api_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    for name in KEY_HEADERS[1:]:
        value = headers.get(name)
        if value:
            return value
    return None


def session_of(headers: Mapping[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None


def resolve(
    headers: Mapping[str, str],
    client_host: str,
    connection_user: str | None,
    query_key: str | None = None,
) -> RolloutIdentity:
    """Apply the four rules; `headers` is case-insensitive (mitmproxy's Headers is);
    `query_key` is the request's `?key=` (Google's API)."""
    session = session_of(headers)
    candidates: tuple[tuple[str, str | None], ...] = (
        (PROXY_AUTH, connection_user),
        (API_KEY, _strip_prefix(api_key(headers)) or _strip_prefix(query_key)),
        (HEADER, headers.get(ROLLOUT_HEADER)),
    )
    for source, value in candidates:
        if value and valid_rollout_id(value):
            group, sample = split_group(value)
            return RolloutIdentity(value, source, group, sample, session)
    if session:
        return RolloutIdentity(
            _UNSAFE.sub("_", f"{client_host}-{session}"), SESSION, None, None, session
        )
    return RolloutIdentity(_UNSAFE.sub("_", client_host), CLIENT_ADDRESS, None, None, None)


def _strip_prefix(key: str | None) -> str | None:
    if key and key.startswith(API_KEY_PREFIX) and len(key) > len(API_KEY_PREFIX):
        return key[len(API_KEY_PREFIX) :]
    return None
