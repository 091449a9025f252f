"""Calls stored as what they add to an earlier call of their rollout: storage linear in tokens.

An agent session re-sends its whole growing conversation every call, so storing each call's
whole prompt ids and request body costs the context length again per call: storage grows with
the square of the session. Instead the journal thread (`PromptDelta.encode`, off the event loop)
stores each call as what it adds to a base call of the same rollout: the one the trajectory merge
names (`Placement.base`, in the row under `DELTA_BASE`: the last call of the chain its prompt
extends, compared exactly there), or for a row without it, the rollout's previous row:

    base_call_id        = that call's id
    prompt_base_len     = n: the ids its prompt shares with the base's prompt + output ids (the
                          sequence a next prompt extends)
    prompt_suffix_ids   = only the ids after those; prompt_token_ids = null
    request_base_prefix = p, request_base_suffix = q: the characters its request_json shares with
                          the base's at the start and at the end (compact JSON: the old messages
                          before, the tools after)
    request_middle      = only the middle; request_json = null

so ``prompt = (prompt(base) + output(base))[:n] + prompt_suffix_ids`` and
``request = request(base)[:p] + request_middle + request(base)[len - q:]``. A null length means
that column is stored whole, in `prompt_token_ids` / `request_json` (the first call of a
rollout, too little shared). So a column named for a whole value holds a whole value or null,
never a part: a reader without this module (DuckDB, pyarrow, `datasets`) cannot take a suffix
for a prompt (schema 3; polar.sql next to this module resolves them in DuckDB alone).

Schema 2 (shards and journals written before) stored the parts under the whole names, telling
them apart by the non-null length; `upgrade_row` and the resolver read that form too (a row
with a length and no part column is a schema-2 row), and `polar-mitm migrate` rewrites it.

Readers (`store.read_table`, the CLI's `captured.read`, and through them every command and
export, and examples/trainer_checks/train_check.py, which loads this file by path: it imports nothing of the
package) call `resolve`, which gives every row its full prompt and request back, so nothing
downstream sees the encoding (the traces dataset always holds whole sequences). A row whose base
is missing (a shard removed by hand) comes back with null there and a warning naming the call,
never a wrong value.
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
# never journaled. This module imports nothing of the package (examples/trainer_checks/train_check.py loads it).
DELTA_BASE = "_delta_base"
# Call ids per rollout the encoder remembers as journaled (a base older than these: stored whole).
MAX_BASES = 256

BASE_COLUMNS = ("base_call_id", "prompt_base_len", "request_base_prefix", "request_base_suffix")
# Each whole column, the column its stored part goes in, and the length that says it is a part.
PARTS = {
    "prompt_token_ids": ("prompt_suffix_ids", "prompt_base_len"),
    "request_json": ("request_middle", "request_base_prefix"),
}
# Every column that only says how a row is stored: read back null once resolved.
DELTA_COLUMNS = (*BASE_COLUMNS, *(part for part, _ in PARTS.values()))
# What a read of a column needs besides it to give it back whole.
NEEDS = {
    "prompt_token_ids": (
        "prompt_suffix_ids",
        "base_call_id",
        "prompt_base_len",
        "output_token_ids",
    ),
    "request_json": (
        "request_middle",
        "base_call_id",
        "request_base_prefix",
        "request_base_suffix",
    ),
}


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A calls row in schema 3's form: a schema-2 row (a journal or shard written before) kept
    its part under the whole column's name; it moves to the part column. Rows already in
    schema 3's form come back as they are (the same dict)."""
    moves = [
        (whole, part)
        for whole, (part, length) in PARTS.items()
        if row.get(length) is not None and row.get(part) is None
    ]
    if not moves:
        return row
    row = dict(row)
    for whole, part in moves:
        row[part], row[whole] = row.get(whole), None
    return row


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
            return upgrade_row(row)
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
                    changes["prompt_suffix_ids"] = array("i", prompt[n:].tobytes())
                    changes["prompt_token_ids"], changes["prompt_base_len"] = None, n
            if request is not None and base_request is not None:
                p, q = shared_ends(base_request, request)
                if p + q >= MIN_SHARED_CHARS:
                    changes["request_middle"] = request[p : len(request) - q]
                    changes["request_json"] = None
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
    """Full prompts and requests of a calls table, each base resolved once (memoized). The table
    may hold rows of schema 1 (whole), 2 (a part under the whole name) and 3 (a part under its own
    name), and may lack the part columns altogether (a table of older shards only)."""

    def __init__(self, table: pa.Table) -> None:
        names = table.column_names
        self.call_ids = table.column("call_id").to_pylist()
        self.index = {c: i for i, c in enumerate(self.call_ids)}
        self.base = table.column("base_call_id").to_pylist()

        def column(name: str) -> list[Any] | None:
            return table.column(name).to_pylist() if name in names else None

        def lists(name: str) -> pa.Array | None:
            return table.column(name).combine_chunks() if name in names else None

        self.prompt_len, self.prefix, self.suffix = (
            column("prompt_base_len"),
            column("request_base_prefix"),
            column("request_base_suffix"),
        )
        self.prompts = self.parts = self.outputs = None
        if self.prompt_len is not None and "prompt_token_ids" in names:
            self.prompts, self.parts = lists("prompt_token_ids"), lists("prompt_suffix_ids")
            self.outputs = lists("output_token_ids")
        self.requests = self.middles = None
        if self.prefix is not None and "request_json" in names:
            self.requests, self.middles = column("request_json"), column("request_middle")

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

    def prompt(self, j: int, base: np.ndarray | None) -> np.ndarray | None:
        """Row `j`'s whole prompt, given its base's prompt + output ids."""
        shared = self.prompt_len[j]
        if shared is None:
            return self.ids(self.prompts, j)
        part = self.ids(self.parts, j)
        if part is None:  # schema 2: the part under the whole name
            part = self.ids(self.prompts, j)
        if part is None or base is None or shared > len(base):
            return None
        return np.concatenate([base[:shared], part])

    def request(self, j: int, base: str | None, own: str | None) -> str | None:
        """Row `j`'s whole request, given its base's; `own`: what row `j` stores whole."""
        p = self.prefix[j]
        if p is None:
            return own
        middle = self.middles[j] if self.middles is not None else None
        if middle is None:  # schema 2: the middle under the whole name
            middle = own
        if base is None or middle is None:
            return None
        return base[:p] + middle + base[len(base) - (self.suffix[j] or 0) :]

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
                    own = prompts[j] = self.prompt(j, seqs.get(k) if k is not None else None)
                    out = self.ids(self.outputs, j)
                    seqs[j] = own if own is None or out is None else np.concatenate([own, out])
                if self.requests is not None:
                    base = requests[k] if k is not None else None
                    requests[j] = self.request(j, base, requests[j])
        return (prompts if self.prompts is not None else None), (
            requests if self.requests is not None else None
        )


def resolve(table: pa.Table) -> pa.Table:
    """The calls table with every row's full prompt ids and request_json (see the module doc);
    the columns that say how a row is stored (`DELTA_COLUMNS`) come back null, since nothing
    then rests on them."""
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
    for name in DELTA_COLUMNS:
        if name in names:
            kind = table.schema.field(name).type
            table = table.set_column(names.index(name), name, pa.nulls(len(table), kind))
    return table
