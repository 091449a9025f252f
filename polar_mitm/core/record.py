"""One record per LLM call, and the sinks that finished records go to.

A `CallRecord` is created when the harness's request is parsed and finished exactly once —
completed, error, client_aborted — so every call leaves a row, never a silent gap. Its fields are
the columns of `store.schema.CALLS_SCHEMA`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from ..store.delta import DELTA_BASE

log = logging.getLogger(__name__)


def now_us() -> int:
    return time.time_ns() // 1000


def new_call_id() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True)
class CallRecord:
    rollout_id: str
    call_id: str = field(default_factory=new_call_id)
    rollout_source: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    session_id: str | None = None
    agent: str | None = None  # the harness's name for the calling agent (lineage.agent_of)
    proxy_id: str | None = None
    started_at: int = field(default_factory=now_us)
    first_byte_at: int | None = None
    finished_at: int | None = None
    dialect: str | None = None
    purpose: str | None = "main"
    method: str | None = None
    host: str | None = None
    path: str | None = None
    stream: bool | None = None
    upstream_kind: str | None = None
    upstream_url: str | None = None
    route: str | None = "chat"
    model_requested: str | None = None
    model_served: str | None = None
    policy_version: str | None = None
    policy_version_end: str | None = None
    prompt_token_ids: Sequence[int] | None = None  # array('i') from the capture path
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    ids_source: str | None = None
    count_check: str | None = None
    finish_reason: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_json: str | None = None
    status: str = "incomplete"
    http_status: int | None = None
    error: str | None = None
    fidelity_flags: list[str] = field(default_factory=list)
    fidelity_json: str | None = None
    trainable: bool = False
    request_json: str | None = None
    response_json: str | None = None
    headers_json: str | None = None
    translation_notes: list[str] = field(default_factory=list)
    # grammar-constrained sampling (upstream/constraints.py): why, and the first output token
    # sampled under the grammar (all later ones were too)
    constrained_by: list[str] = field(default_factory=list)
    constrained_from: int | None = None
    # not a column: the merge's word on which call this one extends (`Placement.base`), for the
    # store's delta encoding (see `to_row`, store/delta.py)
    delta_base: tuple[str, int, str | None] | None = field(default=None, repr=False)

    def mark_first_byte(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = now_us()

    def flag(self, name: str) -> None:
        if name not in self.fidelity_flags:
            self.fidelity_flags.append(name)

    def fidelity_data(self) -> dict[str, Any]:
        """`fidelity_json` as a dict (empty when unset or not an object)."""
        if not self.fidelity_json:
            return {}
        try:
            data = json.loads(self.fidelity_json)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def update_fidelity(self, **items: Any) -> None:
        """Set keys of `fidelity_json`, keeping the others (several stages write there)."""
        data = self.fidelity_data()
        data.update(items)
        self.fidelity_json = json.dumps(data, ensure_ascii=False)

    def to_row(self) -> dict[str, Any]:
        """The calls/ row: the columns, and the merge's delta base under `DELTA_BASE` (the
        journal thread's encoder takes it out; it is never stored)."""
        # Not `dataclasses.asdict`: it deep-copies every list element by element and was 4 % of
        # the event loop under the long load (py-spy --gil). The values are flat (numbers,
        # strings, flat lists and arrays), so a slice copies them as deep as asdict did.
        row = {name: _copied(getattr(self, name)) for name in _COLUMNS}
        if self.delta_base is not None:
            row[DELTA_BASE] = self.delta_base
        return row

    def conform(self) -> None:
        """Make every field fit its column, so the store can never reject the row.

        Most fields are ours; a few come from the upstream's JSON (token ids, finish_reason,
        model). A value of the wrong type or range is dropped and the record flagged
        ``malformed_<field>`` (and not trainable): a record with a gap beats a lost record.
        Once per call, a few microseconds (the id lists are checked by `array`, in C)."""
        bad = []
        for name, check in _CHECKS:
            value = getattr(self, name)
            if value is None:
                continue
            fixed = check(value)
            if fixed is _BAD:
                bad.append(name)
                setattr(self, name, [] if name in _NOT_NULL_LISTS else None)
            elif fixed is not value:
                setattr(self, name, fixed)
        for name in bad:
            self.flag(f"malformed_{name}")
        if bad:
            self.trainable = False


_BAD = object()
_COLUMNS = tuple(f.name for f in fields(CallRecord) if f.name != "delta_base")


def _copied(value: Any) -> Any:
    return value[:] if isinstance(value, list | array) else value


def _typed_list(code: str) -> Any:
    """A check for a list column stored as `array(code)` by the journal."""

    def check(value: Any) -> Any:
        if isinstance(value, array) and value.typecode == code:
            return value
        if not isinstance(value, list):
            return _BAD
        try:
            array(code, value)
        except (TypeError, ValueError, OverflowError):
            return _BAD
        return value

    return check


def _int32(value: Any) -> Any:
    ok = isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31
    return value if ok else _BAD


def _str(value: Any) -> Any:
    """A string that UTF-8 can encode: a header mitmproxy decoded with surrogateescape, say,
    has its undecodable bytes replaced."""
    if not isinstance(value, str):
        return _BAD
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


# The fields whose values may come from outside (the upstream's JSON, the harness's headers).
_CHECKS: tuple[tuple[str, Any], ...] = (
    ("prompt_token_ids", _typed_list("i")),
    ("output_token_ids", _typed_list("i")),
    ("output_logprobs", _typed_list("f")),
    ("usage_prompt_tokens", _int32),
    ("usage_completion_tokens", _int32),
    ("sample_index", _int32),
    ("http_status", _int32),
    ("finish_reason", _str),
    ("model_served", _str),
    ("model_requested", _str),
    ("session_id", _str),
    ("error", _str),
    ("constrained_from", _int32),
)
_NOT_NULL_LISTS = frozenset({"output_token_ids", "output_logprobs"})


class CallSink(Protocol):
    """Anything that wants finished calls: the call's pipeline (`addons/pipeline.py`), and the
    store and the metrics at its end.

    A sink may return a *receipt*: a `concurrent.futures.Future` (or an awaitable) that is done
    once the record is durable (the store: fsynced in the journal). The gateway holds the last
    bytes of a completed reply until its receipts are done; most sinks return None.
    """

    def call_finished(self, record: CallRecord) -> Any: ...


def deliver(record: CallRecord, sinks: Iterable[CallSink]) -> list[Any]:
    """Hand a finished record to every sink; one failing sink must not starve the others.
    Returns the receipts the sinks gave back."""
    receipts = []
    record.conform()
    for sink in sinks:
        try:
            receipt = sink.call_finished(record)
        except Exception:
            log.exception("polar-mitm: %r failed on call %s", sink, record.call_id)
            continue
        if receipt is not None:
            receipts.append(receipt)
    return receipts


def one_receipt(receipts: list[Any]) -> Any:
    """The sinks' receipts as one awaitable (or None when there is nothing to wait for)."""
    if not receipts:
        return None
    if len(receipts) == 1:
        return receipts[0]
    return asyncio.gather(*(awaitable(r) for r in receipts))


def awaitable(receipt: Any) -> Any:
    """A receipt the event loop can await (a thread's `concurrent.futures.Future` is wrapped)."""
    if isinstance(receipt, concurrent.futures.Future):
        return asyncio.wrap_future(receipt)
    return receipt
