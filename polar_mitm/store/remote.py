"""Remote output: ``polar_output=s3://bucket/prefix?endpoint_override=…`` and its siblings.

An ``s3://`` URI is parsed here rather than by ``pyarrow.fs.FileSystem.from_uri`` because the
filesystem needs settings a URI cannot give pyarrow: the AWS client's own retries and timeouts
(its defaults make one failed upload to a dead endpoint take seconds, while the store already
retries with backoff and keeps the rows in the journal meanwhile) and delayed open (a shard below
the multipart threshold is then one PutObject: atomic, and nothing half-uploaded is left behind).

The form::

    s3://BUCKET[/PREFIX][?endpoint_override=HOST:PORT&scheme=http&region=us-east-1&…]

Query keys (all optional): ``region``, ``endpoint_override``, ``scheme`` (``https``), ``retries``
(attempts per request, default 2), ``connect_timeout`` / ``request_timeout`` (seconds, default 2 /
30), ``allow_bucket_creation``, ``force_virtual_addressing``, ``anonymous`` (booleans: true/false),
``tls_ca_file_path``, ``role_arn``. Credentials are never part of the URI — an option value is
printed and logged, and can be saved with ``mitmproxy``'s options; they come from the AWS SDK's
usual chain instead: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` with ``~/.aws/credentials``, or the instance's role. A URI that carries them is
refused, and `display_uri` hides them in any message that shows a URI.

Other schemes (``gs://``, ``hdfs://``, ``file://``, …) go to ``FileSystem.from_uri`` unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

DEFAULT_RETRIES = 2
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_REQUEST_TIMEOUT = 30.0

_SECRET_PARAM = re.compile(r"(key|secret|token|password|credential|signature)", re.IGNORECASE)
_CREDENTIAL_PARAMS = ("access_key", "secret_key", "session_token")


class RemoteOutputError(ValueError):
    """``polar_output`` names a remote location that cannot be used; the message is for users."""


def _bool(name: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise RemoteOutputError(f"{name}={value!r} is not true or false")


def _positive(kind: Callable[[str], Any]) -> Callable[[str, str], Any]:
    def parse(name: str, value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise RemoteOutputError(f"{name}={value!r} is not a number") from None
        if number <= 0:
            raise RemoteOutputError(f"{name}={value!r} must be positive")
        return number

    return parse


def _text(name: str, value: str) -> str:
    if not value:
        raise RemoteOutputError(f"{name} is empty")
    return value


def _scheme(name: str, value: str) -> str:
    if value not in ("http", "https"):
        raise RemoteOutputError(f"{name}={value!r} is not http or https")
    return value


_S3_KEYS: dict[str, Callable[[str, str], Any]] = {
    "region": _text,
    "endpoint_override": _text,
    "scheme": _scheme,
    "retries": _positive(int),
    "connect_timeout": _positive(float),
    "request_timeout": _positive(float),
    "allow_bucket_creation": _bool,
    "force_virtual_addressing": _bool,
    "anonymous": _bool,
    "tls_ca_file_path": _text,
    "role_arn": _text,
}


def display_uri(text: str) -> str:
    """``text`` safe to print: user info and the values of credential-like query keys hidden."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return text.split("://", 1)[0] + "://[unparsable]"
    netloc = parts.netloc.rpartition("@")[2]
    query = urlencode(
        [
            (k, "[redacted]" if _SECRET_PARAM.search(k) else v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="[]:/",
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def s3_filesystem(text: str) -> tuple[pafs.S3FileSystem, str]:
    """(filesystem, ``bucket/prefix``) for an ``s3://`` URI of the form in the module doc."""
    parts = urlsplit(text)
    shown = display_uri(text)
    if "@" in parts.netloc:
        raise RemoteOutputError(
            f"{shown}: credentials do not belong in polar_output (it is logged); set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the proxy instead"
        )
    bucket = parts.netloc
    if not bucket:
        raise RemoteOutputError(f"{shown}: no bucket (expected s3://BUCKET/PREFIX)")
    settings: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in _CREDENTIAL_PARAMS:
            raise RemoteOutputError(
                f"{shown}: {key} does not belong in polar_output (it is logged); set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the proxy instead"
            )
        parse = _S3_KEYS.get(key)
        if parse is None:
            raise RemoteOutputError(
                f"{shown}: unknown query key {key!r} (known: {', '.join(sorted(_S3_KEYS))})"
            )
        settings[key] = parse(key, value)
    retries = settings.pop("retries", DEFAULT_RETRIES)
    settings.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    settings.setdefault("request_timeout", DEFAULT_REQUEST_TIMEOUT)
    try:
        fs = pafs.S3FileSystem(
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=retries),
            allow_delayed_open=True,
            **settings,
        )
    except (TypeError, ValueError, OSError) as exc:
        raise RemoteOutputError(f"{shown}: {exc}") from None
    root = "/".join(p for p in (bucket, parts.path.strip("/")) if p)
    return fs, root
