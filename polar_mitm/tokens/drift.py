"""Token drift: where two token sequences of the same turn part ways, and why. Pure functions.

The sampled ids are the truth; the "other" sequence is what a text pipeline would train on:
the sampled text decoded and encoded again (`roundtrip`), or the turn as the chat template
re-rendered it into the next prompt (`classify_turn`). Everything here takes plain id sequences
and a `PolicyTokenizer` (or None: then only positions and ids are known, no causes), so the
capture path's checks (`tokens/fidelity.py`), the report and a later exact-prefix mode can share
them.

Causes of a re-rendered turn, from its decoded text on both sides:

- ``bpe_resplit``: the same text, other ids (the tokenizer splits the text differently than the
  model sampled it);
- ``special_tokens``: the other side holds a special token where the sampled side spelled its
  text with ordinary tokens;
- ``reasoning_dropped``: a non-empty ``<think>…</think>`` block of the sampled turn is missing;
- ``tool_args_reserialized``: a JSON object (tool-call arguments) parses to the same value on
  both sides but is written with other spacing or key order;
- anything left over is only the generic ``template_rerender`` (e.g. the newline Qwen3 adds
  before a tool call).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BPE_RESPLIT = "bpe_resplit"
TEMPLATE_RERENDER = "template_rerender"
REASONING_DROPPED = "reasoning_dropped"
TOOL_ARGS_RESERIALIZED = "tool_args_reserialized"
SPECIAL_TOKENS = "special_tokens"
COUNT_MISMATCH = "count_mismatch"
FLAGS = (
    BPE_RESPLIT,
    TEMPLATE_RERENDER,
    REASONING_DROPPED,
    TOOL_ARGS_RESERIALIZED,
    SPECIAL_TOKENS,
    COUNT_MISMATCH,
)

CONTEXT = 6  # tokens shown before and after a position
_ALIGN_LIMIT = 4096  # longer turns: wrong tokens from the common prefix and suffix only
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_MAX_JSON_TEXT = 1 << 18


@dataclass(slots=True)
class Cause:
    """One reason a turn differs: its flag and where it starts in the sampled turn."""

    flag: str
    offset: int  # index into the sampled ids
    other_offset: int  # index into the other ids
    note: str | None = None


@dataclass(slots=True)
class TurnDrift:
    """A sampled turn and what a text pipeline would have in its place."""

    offset: int  # first differing index in the sampled ids
    other_offset: int
    wrong: int  # sampled tokens without a counterpart on the other side
    causes: list[Cause] = field(default_factory=list)


# -- sequences ----------------------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int], lo: int = 0) -> int | None:
    """The first index >= lo where a and b differ (the shorter length when one is a prefix of
    the other), or None when they are equal."""
    n = min(len(a), len(b))
    step = 256
    i = lo
    while i < n:  # compare in slices (C speed), then find the index inside the first bad slice
        j = min(n, i + step)
        if a[i:j] != b[i:j]:
            for k in range(i, j):
                if a[k] != b[k]:
                    return k
        i = j
    return None if len(a) == len(b) else n


def common_suffix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def diff_regions(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """The non-equal stretches (a[i1:i2] vs b[j1:j2]) of the best alignment of a and b."""
    return [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in opcodes(a, b) if tag != "equal"]


def wrong_tokens(sampled: Sequence[int], other: Sequence[int], policy_from: int = 0) -> int:
    """How many sampled tokens a pipeline training on `other` gets wrong: those outside the
    stretches the two sequences share (in order), counted from index `policy_from` on."""
    return sum(max(0, i2 - max(i1, policy_from)) for i1, i2, _, _ in diff_regions(sampled, other))


def find_ids(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int | None:
    """First index >= start where `needle` occurs in `haystack` (int32 arrays: bytes.find)."""
    if not needle:
        return start
    hay = _as_bytes(haystack[start:])
    pat = _as_bytes(needle)
    i = hay.find(pat)
    while i != -1 and i % 4:
        i = hay.find(pat, i + 1)
    return None if i == -1 else start + i // 4


def _as_bytes(ids: Sequence[int]) -> bytes:
    from array import array

    if isinstance(ids, array) and ids.typecode == "i":
        return ids.tobytes()
    return array("i", ids).tobytes()


# -- context --------------------------------------------------------------------------------------


def context(
    tok: Any, sampled: Sequence[int], other: Sequence[int], pos: int, other_pos: int
) -> dict[str, Any]:
    """A short view of a difference: the tokens just before it, and the tokens from it on, on
    both sides (decoded one by one when there is a tokenizer, ids otherwise)."""
    before = list(sampled[max(0, pos - CONTEXT) : pos])
    mine = list(sampled[pos : pos + CONTEXT])
    theirs = list(other[other_pos : other_pos + CONTEXT])
    out: dict[str, Any] = {"sampled_ids": mine, "other_ids": theirs}
    if tok is not None:
        out["before"] = tok.token_strs(before)
        out["sampled"] = tok.token_strs(mine)
        out["other"] = tok.token_strs(theirs)
    else:
        out["before_ids"] = before
    return out


def token_at_char(tok: Any, ids: Sequence[int], char: int) -> int:
    """The index of the token of `ids` whose decoded text holds character `char`."""
    lo, hi = 0, len(ids)
    while lo < hi:  # smallest k with len(decode(ids[:k + 1])) > char
        mid = (lo + hi) // 2
        if len(tok.decode(ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return min(lo, max(len(ids) - 1, 0))


# -- the call's own text ---------------------------------------------------------------------------


def roundtrip(tok: Any, ids: Sequence[int]) -> tuple[list[int], list[Cause], int]:
    """Decode the sampled ids and encode the text again, as a pipeline that stores text would.

    Returns (the re-encoded ids, one cause per differing stretch — ``special_tokens`` when the
    re-encoded stretch holds a special token the sampled one spelled with ordinary tokens, else
    ``bpe_resplit`` — and the number of sampled tokens it gets wrong)."""
    again = tok.encode(tok.decode(ids))
    if list(ids) == again:
        return again, [], 0
    specials = set(tok.specials.values())
    causes = []
    wrong = 0
    for i1, i2, j1, j2 in diff_regions(ids, again):
        wrong += i2 - i1
        made = {t for t in again[j1:j2] if t in specials} - set(ids[i1:i2])
        causes.append(Cause(SPECIAL_TOKENS if made else BPE_RESPLIT, i1, j1))
    return again, causes, wrong


# -- a re-rendered turn ----------------------------------------------------------------------------


def classify_turn(
    tok: Any, sampled: Sequence[int], other: Sequence[int], policy_from: int = 0
) -> TurnDrift | None:
    """How the re-rendered turn `other` differs from the sampled turn, or None when it does not.
    `sampled` may start with `policy_from` environment tokens (a difference that straddles the
    turn's start); they are not counted as wrong.

    Each differing stretch whose text is the same on both sides is a re-split (``bpe_resplit``,
    or ``special_tokens`` when the other side made a special token of it); the texts tell
    ``reasoning_dropped`` and ``tool_args_reserialized``; what is left is the generic
    ``template_rerender``. Without a tokenizer only the position and the wrong-token count
    are known."""
    pos = first_difference(sampled, other)
    if pos is None:
        return None
    ops = opcodes(sampled, other)
    wrong = sum(max(0, i2 - max(i1, policy_from)) for t, i1, i2, _, _ in ops if t != "equal")
    drift = TurnDrift(pos, pos, wrong)
    if tok is None:
        return drift
    specials = set(tok.specials.values())
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal" or tok.decode(sampled[i1:i2]) != tok.decode(other[j1:j2]):
            continue
        made = {t for t in other[j1:j2] if t in specials} - set(sampled[i1:i2])
        if not any(c.flag in (BPE_RESPLIT, SPECIAL_TOKENS) for c in drift.causes):
            drift.causes.append(Cause(SPECIAL_TOKENS if made else BPE_RESPLIT, i1, j1))
    s_text, o_text = tok.decode(sampled), tok.decode(other)
    s_rest, o_rest = s_text, o_text
    m = _THINK.search(s_text)
    if m and m.group(1).strip() and m.group(1).strip() not in o_text:
        at = token_at_char(tok, sampled, m.start())
        drift.causes.append(Cause(REASONING_DROPPED, at, map_offset(ops, at)))
        s_rest, o_rest = _THINK_BLOCK.sub("", s_text), _THINK_BLOCK.sub("", o_text)
    reserialized = _reserialized_json(s_text, o_text)
    if reserialized is not None:
        s_char, _, note = reserialized
        at = token_at_char(tok, sampled, s_char)
        drift.causes.append(Cause(TOOL_ARGS_RESERIALIZED, at, map_offset(ops, at), note))
        s_rest, o_rest = _canonical_json(s_rest), _canonical_json(o_rest)
    if s_rest != o_rest:
        drift.causes.append(Cause(TEMPLATE_RERENDER, pos, pos, "other rendering"))
    drift.causes.sort(key=lambda c: c.offset)
    return drift


def opcodes(a: Sequence[int], b: Sequence[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes of the best alignment of a and b (long sequences: one differing
    stretch between the common prefix and suffix)."""
    if len(a) + len(b) > 2 * _ALIGN_LIMIT:
        p = first_difference(a, b)
        if p is None:
            return [("equal", 0, len(a), 0, len(b))]
        s = common_suffix(a, b, min(len(a), len(b)) - p)
        return [
            ("equal", 0, p, 0, p),
            ("replace", p, len(a) - s, p, len(b) - s),
            ("equal", len(a) - s, len(a), len(b) - s, len(b)),
        ]
    return difflib.SequenceMatcher(None, list(a), list(b), autojunk=False).get_opcodes()


def map_offset(ops: Sequence[tuple[str, int, int, int, int]], offset: int) -> int:
    """Where index `offset` of the first sequence lands in the second, by the alignment."""
    for tag, i1, i2, j1, j2 in ops:
        if i1 <= offset < i2 or (i1 == i2 == offset):
            if tag == "equal":
                return j1 + offset - i1
            return j1 + min(offset - i1, max(j2 - j1 - 1, 0))
    return ops[-1][4] if ops else offset


def _json_objects(text: str) -> list[tuple[int, int, Any]]:
    """(start, end, value) of the top-level JSON objects in `text`, outside think blocks."""
    if len(text) > _MAX_JSON_TEXT:
        return []
    skip = [(m.start(), m.end()) for m in _THINK.finditer(text)]
    decoder = json.JSONDecoder()
    found = []
    i = text.find("{")
    while i != -1:
        if any(a <= i < b for a, b in skip):
            i = text.find("{", i + 1)
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        found.append((i, end, value))
        i = text.find("{", end)
    return found


def _reserialized_json(a: str, b: str) -> tuple[int, int, str] | None:
    """The first pair of JSON objects (in order) equal as values but not as text:
    (offset in a, offset in b where their texts first differ, a note)."""
    for (a0, a1, av), (b0, b1, bv) in zip(_json_objects(a), _json_objects(b), strict=False):
        at, bt = a[a0:a1], b[b0:b1]
        if at == bt or av != bv:
            continue
        k = 0
        while k < min(len(at), len(bt)) and at[k] == bt[k]:
            k += 1
        same_order = json.dumps(av, sort_keys=True) == json.dumps(bv, sort_keys=True) and list(
            _keys(av)
        ) == list(_keys(bv))
        note = "spacing" if same_order else "key order"
        return a0 + k, b0 + k, note
    return None


def _keys(value: Any) -> Iterable[str]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def _canonical_json(text: str) -> str:
    out, last = [], 0
    for start, end, value in _json_objects(text):
        out.append(text[last:start])
        out.append(json.dumps(value, sort_keys=True))
        last = end
    out.append(text[last:])
    return "".join(out)


# -- summaries -------------------------------------------------------------------------------------


def trace_summary(
    chain_calls: Sequence[Any], rollout_calls: Sequence[Any]
) -> dict[str, Any] | None:
    """The fidelity summary of one trace (`traces.fidelity_json`), from its calls' facts.

    A drift is found when a later call re-renders an earlier turn, so it is flagged on that
    later call: `observed` lists, per flag, the calls that saw drift in this trace's turns
    (they may sit in another trace). `policy_tokens_wrong` counts this trace's sampled tokens
    a text pipeline gets wrong (each turn once: the largest count any check found for it)."""
    mine = {c.call_id for c in chain_calls}
    checked = [c for c in chain_calls if getattr(c, "fidelity", None)]
    if not checked and not any(getattr(c, "fidelity", None) for c in rollout_calls):
        return None
    flags: dict[str, list[str]] = {}
    for c in chain_calls:
        for f in c.flags:
            flags.setdefault(f, []).append(c.call_id)
    wrong: dict[str, int] = {}
    observed: dict[str, list[str]] = {}
    for c in rollout_calls:
        info = getattr(c, "fidelity", None) or {}
        for turn, n in (info.get("wrong") or {}).items():
            if turn in mine:
                wrong[turn] = max(wrong.get(turn, 0), int(n))
        for flag, turns in (info.get("turns") or {}).items():
            if any(t in mine for t in turns):
                observed.setdefault(flag, []).append(c.call_id)
    return {
        "calls_checked": len(checked),
        "flags": flags,
        "observed": observed,
        "policy_tokens_wrong": sum(wrong.values()),
    }
