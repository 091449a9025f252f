"""Calls stored as what they add to an earlier call of their rollout (schema 2): storage linear in tokens.

An agent session re-sends its whole growing conversation every call, so storing each call's
whole prompt ids and request body costs the context length again per call: storage grows with
the square of the session. Instead the journal thread (`PromptDelta.encode`, off the event loop)
stores each call as what it adds to a base call of the same rollout: the one the trajectory merge
names (`Placement.base`, in the row under `DELTA_BASE`: the last call of the chain its prompt
extends, compared exactly there), or for a row without it, the rollout's previous row:

    base_call_id        = that call's id
    prompt_base_len     = n: the ids its prompt shares with the base's prompt + output ids (the
                          sequence a next prompt extends); prompt_token_ids = only the ids after
    request_base_prefix = p, request_base_suffix = q: the characters its request_json shares with
                          the base's at the start and at the end (compact JSON: the old messages
                          before, the tools after); request_json = only the middle

so ``prompt = (prompt(base) + output(base))[:n] + stored`` and
``request = request(base)[:p] + stored + request(base)[len - q:]``. A null length means that
column is stored whole (the first call of a rollout, too little shared, a schema-1 shard).

Readers (`store.read_table`, the CLI's `captured.read`, and through them every command and
export) call `resolve`, which gives every row its full prompt and request back, so nothing
downstream sees the encoding (engines reading the Parquet files directly see the stored form; the
traces dataset always holds whole sequences). A row whose base is missing (a shard removed by
hand) comes back with null there and a warning naming the call, never a wrong value.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger("polar_mitm.store")

# Sharing less than this, store the column whole (a reference would save nothing).
MIN_SHARED_IDS, MIN_SHARED_CHARS = 64, 256
# Rollouts whose last call the encoder keeps (least recently used dropped first): bounds the
# journal thread's memory when rollouts never end; a dropped one starts again in full.
MAX_ROLLOUTS = 4096
# The row key under which a calls row brings the merge's base (`CallRecord.to_row`): no column,
# never journaled. This module imports nothing of the package (scripts/train_check.py loads it).
DELTA_BASE = "_delta_base"
# Call ids per rollout the encoder remembers as journaled (a base older than these: stored whole).
MAX_BASES = 256

BASE_COLUMNS = ("base_call_id", "prompt_base_len", "request_base_prefix", "request_base_suffix")
# What a read of a column needs besides it to give it back whole.
NEEDS = {
    "prompt_token_ids": ("base_call_id", "prompt_base_len", "output_token_ids"),
    "request_json": ("base_call_id", "request_base_prefix", "request_base_suffix"),
}


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids `a` and `b` have in common (vectorized: contexts are 100k ids)."""
    m = min(len(a), len(b))
    if m == 0 or np.array_equal(a[:m], b[:m]):
        return m
    return int(np.argmax(a[:m] != b[:m]))


def shared_ends(a: str, b: str) -> tuple[int, int]:
    """Characters `a` and `b` share at the start and (not overlapping that) at the end, by
    binary search over slice comparisons (each a memcmp: requests are hundreds of KB)."""
    m = min(len(a), len(b))
    lo, hi = 0, m
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    prefix = lo
    lo, hi = 0, m - prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return prefix, lo


def _ids(value: Any) -> np.ndarray | None:
    if isinstance(value, array) and value.typecode == "i":
        return np.frombuffer(value, dtype=np.int32) if len(value) else np.empty(0, np.int32)
    return None


class _Seen:
    """What the encoder keeps of one rollout: its recently journaled call ids (a base must be one
    of them: journaled before the call that rests on it) and its last call, for rows that come
    without the merge's base (`DELTA_BASE`)."""

    __slots__ = ("ids", "last")

    def __init__(self) -> None:
        self.ids: OrderedDict[str, None] = OrderedDict()
        # (call_id, prompt + output ids, request_json) of the last call; the ids only when
        # the row came without the merge's base (with it, the chain in the merge holds them)
        self.last: tuple[str, np.ndarray | None, str | None] | None = None

    def journaled(self, call_id: str) -> None:
        self.ids[call_id] = None
        while len(self.ids) > MAX_BASES:
            self.ids.popitem(last=False)


class PromptDelta:
    """The journal thread's encoder: one per `Store`, used by that thread alone.

    A calls row from the proxy carries the trajectory merge's word on which call it extends and
    by how many ids (`DELTA_BASE`: the merge compared the ids exactly, and keeps them in its
    chains), so the encoder need not keep a copy of every open rollout's ids: it checks that
    the base was journaled first and slices. A row without it (another producer, a test) is
    compared with the rollout's previous row, whose ids the encoder then keeps."""

    def __init__(self, max_rollouts: int = MAX_ROLLOUTS) -> None:
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._max = max_rollouts

    def encode(self, dataset: str, row: dict[str, Any]) -> dict[str, Any]:
        """The row to journal (a new dict when encoded; `row` is never changed). A traces row
        ends its rollout here: its calls are all in, nothing will extend them."""
        hint = row.get(DELTA_BASE)
        if hint is not None:
            row = {k: v for k, v in row.items() if k != DELTA_BASE}
        if dataset == "traces":
            self._seen.pop(str(row.get("rollout_id")), None)
            return row
        rollout, call_id = row.get("rollout_id"), row.get("call_id")
        if dataset != "calls" or not isinstance(rollout, str) or not isinstance(call_id, str):
            return row
        if row.get("base_call_id") is not None:  # already encoded: a replayed row
            return row
        prompt, request = _ids(row.get("prompt_token_ids")), row.get("request_json")
        request = request if isinstance(request, str) else None
        seen = self._seen.get(rollout)
        if seen is None:
            seen = self._seen[rollout] = _Seen()
        changes: dict[str, Any] = {}
        base_id, base_seq_len, base_seq, base_request = None, 0, None, None
        if hint is not None:
            if hint[0] in seen.ids and hint[0] != call_id:
                base_id, base_seq_len, base_request = hint
        elif seen.last is not None and seen.last[0] != call_id:  # the same call twice: a
            base_id, base_seq, base_request = seen.last  # crash's duplicate
        if base_id is not None:
            if prompt is not None:
                n = shared_prefix(base_seq, prompt) if base_seq is not None else base_seq_len
                if MIN_SHARED_IDS <= n <= len(prompt):
                    changes["prompt_token_ids"] = array("i", prompt[n:].tobytes())
                    changes["prompt_base_len"] = n
            if request is not None and base_request is not None:
                p, q = shared_ends(base_request, request)
                if p + q >= MIN_SHARED_CHARS:
                    changes["request_json"] = request[p : len(request) - q]
                    changes["request_base_prefix"], changes["request_base_suffix"] = p, q
            if changes:
                changes["base_call_id"] = base_id
        seq = None
        if hint is None:
            output = _ids(row.get("output_token_ids"))
            seq = prompt
            if prompt is not None and output is not None and len(output):
                seq = np.concatenate([prompt, output])
        seen.last = (call_id, seq, request)
        seen.journaled(call_id)
        self._seen.move_to_end(rollout)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return {**row, **changes} if changes else row


class _Resolver:
    """Full prompts and requests of a calls table, each base resolved once (memoized)."""

    def __init__(self, table: pa.Table) -> None:
        names = table.column_names
        self.call_ids = table.column("call_id").to_pylist()
        self.index = {c: i for i, c in enumerate(self.call_ids)}
        self.base = table.column("base_call_id").to_pylist()

        def column(name: str) -> list[Any] | None:
            return table.column(name).to_pylist() if name in names else None

        self.prompt_len, self.prefix, self.suffix = (
            column("prompt_base_len"),
            column("request_base_prefix"),
            column("request_base_suffix"),
        )
        self.prompts = self.outputs = None
        if self.prompt_len is not None and "prompt_token_ids" in names:
            self.prompts = table.column("prompt_token_ids").combine_chunks()
            if "output_token_ids" in names:
                self.outputs = table.column("output_token_ids").combine_chunks()
        has_request = self.prefix is not None and "request_json" in names
        self.requests = column("request_json") if has_request else None

    def ids(self, column: pa.Array | None, i: int) -> np.ndarray | None:
        if column is None or not column[i].is_valid:
            return None
        return column[i].values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)

    def order(self, i: int) -> list[int]:
        """Row `i` and the rows it rests on, oldest first; a base that is missing (or a cycle)
        ends the chain, with a warning."""
        chain, seen = [i], {i}
        while self.base[chain[-1]] is not None:
            k = self.index.get(self.base[chain[-1]])
            if k is None or k in seen:
                log.warning(
                    "polar store: call %s extends call %s, which is not in the shards read; "
                    "what it shares with that call comes back null",
                    self.call_ids[chain[-1]],
                    self.base[chain[-1]],
                )
                break
            chain.append(k)
            seen.add(k)
        return chain[::-1]

    def resolve(self) -> tuple[list[np.ndarray | None] | None, list[str | None] | None]:
        n = len(self.call_ids)
        seqs: dict[int, np.ndarray | None] = {}  # prompt + output ids (what a next one extends)
        prompts: list[np.ndarray | None] = [None] * n
        requests: list[str | None] = list(self.requests) if self.requests is not None else []
        done: set[int] = set()
        for i in range(n):
            for j in self.order(i):
                if j in done:
                    continue
                done.add(j)
                k = self.index.get(self.base[j]) if self.base[j] is not None else None
                k = k if k in done and k != j else None
                if self.prompts is not None:
                    own = self.ids(self.prompts, j)
                    shared = self.prompt_len[j]
                    if shared is not None:
                        whole = seqs.get(k) if k is not None else None
                        own = (
                            None
                            if own is None or whole is None or shared > len(whole)
                            else np.concatenate([whole[:shared], own])
                        )
                    prompts[j] = own
                    out = self.ids(self.outputs, j)
                    seqs[j] = own if own is None or out is None else np.concatenate([own, out])
                if self.requests is not None and self.prefix[j] is not None:
                    whole_request = requests[k] if k is not None else None
                    p, q, own_request = self.prefix[j], self.suffix[j] or 0, requests[j]
                    requests[j] = (
                        None
                        if whole_request is None or own_request is None
                        else whole_request[:p]
                        + own_request
                        + whole_request[len(whole_request) - q :]
                    )
        return (prompts if self.prompts is not None else None), (
            requests if self.requests is not None else None
        )


def resolve(table: pa.Table) -> pa.Table:
    """The calls table with every row's full prompt ids and request_json (see the module doc);
    the base columns come back null, since nothing then rests on them."""
    names = table.column_names
    if "base_call_id" not in names or table.column("base_call_id").null_count == len(table):
        return table
    prompts, requests = _Resolver(table).resolve()
    if prompts is not None:
        lengths = np.array([0 if v is None else len(v) for v in prompts], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = np.concatenate([v for v in prompts if v is not None] or [np.empty(0, np.int32)])
        ids = pa.LargeListArray.from_arrays(
            pa.array(offsets),
            pa.array(flat, pa.int32()),
            mask=pa.array([v is None for v in prompts]),
        ).cast(table.schema.field("prompt_token_ids").type)
        table = table.set_column(names.index("prompt_token_ids"), "prompt_token_ids", ids)
    if requests is not None:
        column = pa.array(requests, table.schema.field("request_json").type)
        table = table.set_column(names.index("request_json"), "request_json", column)
    for name in BASE_COLUMNS:
        if name in names:
            kind = table.schema.field(name).type
            table = table.set_column(names.index(name), name, pa.nulls(len(table), kind))
    return table
