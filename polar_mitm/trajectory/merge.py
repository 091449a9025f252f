"""Prefix merging: every call of a rollout joins the chain whose tokens its prompt extends.

A chain's token sequence is the prompts and sampled outputs of its calls, each output through
its end-of-turn token. A call whose prompt starts with a chain's whole sequence extends that
chain: the prompt tokens after it are the environment's (tool results, user turns; loss mask 0),
the output tokens are the policy's (mask 1, with their logprobs). The longest such chain wins.
A call that extends no chain starts a new one; its parent is the chain sharing the longest
common prefix with its prompt, and `breaks.classify_break` says why it broke off. The new
chain's whole prompt is context (mask 0): the tokens it shares with the parent were sampled
there, and each sampled token is trained once.

Cost per call. Chains keep their tokens in `array('i')`, compared in place with libc's
`memcmp` (through ctypes; slice comparison where that is not available), never copied.
Joining: the chains a call may join are indexed by (length, last `TAIL` tokens); a call probes
one key per distinct chain length and checks the hit with one memcmp of the prefix, then
extends the chain's arrays in place: Python-level work is O(chains + new tokens), plus the one
memcmp (about 0.15 ns per token) that no exact method can skip.
Breaking off: every chain's block-aligned prefixes (`BLOCK` tokens) are hashed into an index as
the chain grows, so the longest common prefix over all chains takes O(prefix / BLOCK) probes plus
one comparison of at most a block, and the winner is verified with one memcmp (a hash collision
falls back to comparing every chain, still at memcmp speed).

Prompts given as `array('i')` are used as they are; lists are converted once (about 14 ns per
token, the largest fixed cost: the capture path hands arrays).

The merge is one data structure: `Chain`'s arrays and the two indexes `Merger` keeps over them,
read in place (no copies); what a chain becomes as a `traces/` row, and whether it is trainable,
is `rows.py`, the break reasons are in `breaks`, the rollouts in `rollouts`.
"""

from __future__ import annotations

import bisect
import ctypes
import sys
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .breaks import (
    FIRST_CALL,
    SIDE_CALL,
    SUB_AGENT,
    BreakEvidence,
    RequestView,
    classify_break,
    history_change,
    is_side,
    request_view,
)
from .lineage import is_agent, parent_agent

TAIL = 8  # tokens of a chain's end in the join index key
BLOCK = 256  # tokens per hashed prefix block
_SEED = 0x9E3779B97F4A7C15
_POLICY = b"\x01"
# A request body parsed for break evidence: (view,) once parsed (the view may be None), None before.
Parsed = tuple[RequestView | None] | None


@dataclass(slots=True)
class CallFacts:
    """What a trace needs to know about one call (not the record itself: that holds its JSON)."""

    call_id: str
    status: str = "completed"
    ids_source: str | None = "upstream"
    flags: tuple[str, ...] = ()
    policy_version: str | None = None
    policy_version_end: str | None = None
    error: str | None = None
    trainable: bool = True  # the capture path's verdict on the call's tokens (record.trainable)
    # the fidelity checks' findings (tokens/fidelity.py): {"wrong": {turn call id: tokens},
    # "turns": {flag: [turn call ids]}}; None when the call was not checked
    fidelity: dict[str, Any] | None = None
    rollout_source: str | None = None  # which identity rule named the rollout (call.identity)
    # the first output token sampled under a grammar (record.constrained_from), if any
    constrained_from: int | None = None


@dataclass(slots=True)
class Placement:
    """Where `Merger.add` put a call."""

    trace_id: str
    _: KW_ONLY
    attached: bool  # extended an existing chain
    break_reason: str | None  # set when the call started a chain
    parent_trace_id: str | None
    prefix_len: int  # attached: chain length before the call; new chain: common prefix with parent
    env_tokens: int
    policy_tokens: int
    detail: dict[str, Any] | None = None
    # (call id, n, its request JSON): the call whose prompt + output ids this call's prompt
    # extends by its first n ids (the store keeps only the rest: store/delta.py)
    base: tuple[str, int, str | None] | None = None


class Chain:
    """One merged token sequence and the calls that built it."""

    __slots__ = (
        "trace_id",
        "role",
        "parent",
        "prefix_len",
        "break_reason",
        "break_detail",
        "tokens",
        "policy_logprobs",
        "calls",
        "call_offsets",
        "output_offsets",
        "hashes",
        "last_request",
        "_view",
        "purpose",
        "agent",
    )

    def __init__(
        self,
        trace_id: str,
        role: str,
        *,
        parent: Chain | None,
        prefix_len: int,
        break_reason: str,
        break_detail: dict[str, Any] | None,
        purpose: str = "main",
        agent: str | None = None,
    ) -> None:
        self.trace_id = trace_id
        self.role = role  # main | sub | side
        self.parent = parent
        self.prefix_len = prefix_len
        self.break_reason = break_reason
        self.break_detail = break_detail
        self.tokens = array("i")
        # the sampled tokens' logprobs only, in order: an agent chain is mostly environment
        # tokens, whose 0.0 would cost 4 bytes each for as long as the rollout is open
        self.policy_logprobs = array("f")
        self.calls: list[CallFacts] = []
        self.call_offsets = array("i")  # where each call's new tokens start
        self.output_offsets = array("i")  # where each call's sampled tokens start
        self.hashes: list[int] = []  # hash of the prefix of (i + 1) * BLOCK tokens
        self.last_request: str | None = None  # request JSON of the last call (for breaks)
        self._view: Parsed = None  # last_request parsed; set again with it by Merger._append
        self.purpose = purpose  # of the call that started the chain (main, compaction, title...)
        self.agent = agent  # the harness's name for the agent whose calls these are, if it has one

    def request_view(self) -> RequestView | None:
        """`last_request` parsed (once: a harness's request is often megabytes of JSON, and
        every break off this chain compares against it)."""
        if self._view is None:
            self._view = (request_view(self.last_request),)
        return self._view[0]

    def __len__(self) -> int:
        return len(self.tokens)

    def _sampled(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each call's sampled tokens: from its output offset to the next
        call's first token (the chain's end for the last call)."""
        return zip(self.output_offsets, [*self.call_offsets[1:], len(self.tokens)], strict=True)

    @property
    def mask(self) -> array:
        """The loss mask, aligned with `tokens`: 1 on each call's sampled tokens, 0 on the
        rest (built when asked, for the trace row: the offsets say it all)."""
        out = array("b", bytes(len(self.tokens)))
        for start, end in self._sampled():
            out[start:end] = array("b", _POLICY * (end - start))
        return out

    @property
    def logprobs(self) -> array:
        """Aligned with `tokens`: each call's sampled tokens have their logprobs, the rest 0.0
        (built when asked: for the trace row)."""
        out = array("f", bytes(4 * len(self.tokens)))
        src, j = self.policy_logprobs, 0
        for start, end in self._sampled():
            out[start:end] = src[j : j + end - start]
            j += end - start
        return out

    @property
    def call_ids(self) -> list[str]:
        return [c.call_id for c in self.calls]

    @property
    def policy_tokens(self) -> int:
        return len(self.policy_logprobs)  # one per sampled token

    def locate(self, pos: int) -> tuple[int, str]:
        """(index of the call whose tokens hold position `pos`, "env" | "policy" | "end")."""
        if pos >= len(self.tokens) or not self.calls:
            return len(self.calls) - 1, "end"
        i = bisect.bisect_right(self.call_offsets, pos) - 1
        return i, "policy" if pos >= self.output_offsets[i] else "env"


def _as_ids(values: Sequence[int]) -> array:
    if isinstance(values, array) and values.typecode == "i":
        return values
    try:
        return array("i", values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be int32 integers: {e}") from None


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL("msvcrt" if sys.platform == "win32" else None)
        fn = libc.memcmp
    except (OSError, AttributeError):  # pragma: no cover - no C library to call
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_memcmp = _load_memcmp()


def _equal(a: array, b: array, lo: int, hi: int) -> bool:
    """a[lo:hi] == b[lo:hi] for two int32 arrays holding at least `hi` items, without copies."""
    if hi <= lo:
        return True
    if _memcmp is not None:
        return _memcmp(a.buffer_info()[0] + 4 * lo, b.buffer_info()[0] + 4 * lo, 4 * (hi - lo)) == 0
    return a[lo:hi] == b[lo:hi]


def _lcp(a: array, b: array, lo: int, hi: int) -> int:
    """First index in [lo, hi) where a and b differ, given a[:lo] == b[:lo]; hi if none."""
    while hi - lo > 32:  # halve with memcmp, then finish by hand
        mid = (lo + hi) // 2
        if _equal(a, b, lo, mid):
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if a[i] != b[i]:
            return i
    return hi


class Merger:
    """The chains of one rollout. Pure: no I/O, no clock; `add` every call in finishing order."""

    def __init__(self, new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.new_id = new_id
        self.chains: list[Chain] = []
        self._ends: dict[tuple[int, bytes], list[Chain]] = {}
        self._end_lengths: dict[int, int] = {}
        self._blocks_all: dict[int, list[Chain]] = {}
        self._blocks_join: dict[int, list[Chain]] = {}

    # -- the one entry point ------------------------------------------------------------------

    def add(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        logprobs: Sequence[float] = (),
        *,
        facts: CallFacts | None = None,
        purpose: str | None = "main",
        request_json: str | None = None,
        agent: str | None = None,
    ) -> Placement:
        """Place one finished call; raises ValueError for ids that are not int32.

        `agent` is the harness's name for the agent that made the call (Codex names each of its
        agents): a call joins only its own agent's chains, and breaks off its own agent's chain
        when it has one; a call of a new agent starts a ``sub`` chain."""
        facts = facts or CallFacts(call_id=self.new_id())
        p = _as_ids(prompt)
        out = _as_ids(output)
        side = is_side(purpose)
        if not side:
            chain = self._joinable(p, agent)
            if chain is not None:
                return self._extend(chain, p, out, logprobs, facts, request_json)
        parent, lcp, hashes = self._longest_common(p, joinable=not side)
        if agent is not None and not side and (parent is None or parent.agent != agent):
            parent, lcp = self._agent_parent(p, agent, parent, lcp)
        has_chains = any(c.role != "side" for c in self.chains)
        evidence, diverged_call, parsed = self._evidence(
            parent, lcp, p, purpose, has_chains, request_json, agent
        )
        reason = classify_break(evidence)
        if reason == FIRST_CALL:
            parent, lcp = None, 0
        detail = _break_detail(parent, lcp, len(p), evidence, diverged_call)
        chain = Chain(
            self.new_id(),
            _role(reason, parent),
            parent=parent,
            prefix_len=lcp,
            break_reason=reason,
            break_detail=detail,
            purpose=purpose or "main",
            agent=agent,
        )
        self._open(chain, hashes[: len(p) // BLOCK])
        base = _base(parent, lcp) if parent is not None else None
        self._append(chain, p, 0, out, logprobs, facts, request_json, parsed)
        return Placement(
            chain.trace_id,
            attached=False,
            break_reason=reason,
            parent_trace_id=parent.trace_id if parent else None,
            prefix_len=lcp,
            env_tokens=len(p),
            policy_tokens=len(out),
            detail=detail,
            base=base,
        )

    def _extend(
        self,
        chain: Chain,
        p: array,
        out: array,
        logprobs: Sequence[float],
        facts: CallFacts,
        request_json: str | None,
    ) -> Placement:
        """The call's prompt extends `chain`: its new tokens and its output are appended."""
        start = len(chain)
        base = _base(chain, start)
        self._unindex_end(chain)
        self._append(chain, p, start, out, logprobs, facts, request_json)
        return Placement(
            chain.trace_id,
            attached=True,
            break_reason=None,
            parent_trace_id=None,
            prefix_len=start,
            env_tokens=len(p) - start,
            policy_tokens=len(out),
            base=base,
        )

    def _open(self, chain: Chain, hashes: list[int]) -> None:
        """A new chain, with its prompt's hashed blocks in the indexes (side chains are never
        joined, so only the all-chains index has theirs)."""
        chain.hashes = hashes
        for h in hashes:
            self._blocks_all.setdefault(h, []).append(chain)
            if chain.role != "side":
                self._blocks_join.setdefault(h, []).append(chain)
        self.chains.append(chain)

    def _agent_parent(
        self, p: array, agent: str, parent: Chain | None, lcp: int
    ) -> tuple[Chain | None, int]:
        """The chain a call of a named agent breaks off: its own agent's when it has one, else
        its parent agent's (lineage.parent_agent: the agent that started it), even when another
        chain shares more tokens; the longest common prefix when neither has a chain."""
        pool = [c for c in self.chains if c.role != "side"]
        own = [c for c in pool if c.agent == agent]
        if not own:
            up = parent_agent(agent)
            own = [c for c in pool if up is not None and is_agent(c.agent, up)]
        return self._best(p, own, 0) if own else (parent, lcp)

    # -- joining --------------------------------------------------------------------------------

    def _joinable(self, p: array, agent: str | None = None) -> Chain | None:
        """The longest non-side chain of `agent` whose whole sequence starts `p`."""
        n = len(p)
        for length in sorted(self._end_lengths, reverse=True):
            if length > n:
                continue
            key = (length, p[max(0, length - TAIL) : length].tobytes())
            for chain in reversed(self._ends.get(key, ())):
                if chain.agent == agent and _equal(p, chain.tokens, 0, length):
                    return chain
        return None

    def _index_end(self, chain: Chain) -> None:
        n = len(chain)
        if chain.role == "side" or n == 0:
            return
        key = (n, chain.tokens[max(0, n - TAIL) :].tobytes())
        self._ends.setdefault(key, []).append(chain)
        self._end_lengths[n] = self._end_lengths.get(n, 0) + 1

    def _unindex_end(self, chain: Chain) -> None:
        n = len(chain)
        key = (n, chain.tokens[max(0, n - TAIL) :].tobytes())
        chains = self._ends.get(key)
        if chains is None or chain not in chains:
            return
        chains.remove(chain)
        if not chains:
            del self._ends[key]
        left = self._end_lengths[n] - 1
        if left:
            self._end_lengths[n] = left
        else:
            del self._end_lengths[n]

    def _append(
        self,
        chain: Chain,
        p: array,
        start: int,
        out: array,
        logprobs: Sequence[float],
        facts: CallFacts,
        request_json: str | None,
        parsed: Parsed = None,
    ) -> None:
        chain.call_offsets.append(len(chain))
        chain.tokens.extend(p[start:] if start else p)
        chain.output_offsets.append(len(chain))
        k = len(out)
        chain.tokens.extend(out)
        chain.policy_logprobs.extend(_aligned(logprobs, k))
        chain.calls.append(facts)
        chain.last_request, chain._view = request_json, parsed
        self._hash_blocks(chain)
        self._index_end(chain)

    # -- breaking off ---------------------------------------------------------------------------

    def _hash_blocks(self, chain: Chain) -> None:
        tokens, hashes = chain.tokens, chain.hashes
        join = chain.role != "side"
        h = hashes[-1] if hashes else _SEED
        for k in range(len(hashes), len(tokens) // BLOCK):
            h = hash((h, tokens[k * BLOCK : (k + 1) * BLOCK].tobytes()))
            hashes.append(h)
            self._blocks_all.setdefault(h, []).append(chain)
            if join:
                self._blocks_join.setdefault(h, []).append(chain)

    def _longest_common(self, p: array, joinable: bool) -> tuple[Chain | None, int, list[int]]:
        """(chain with the longest common prefix, its length, the prompt's block hashes so far)."""
        index = self._blocks_join if joinable else self._blocks_all
        pool = [c for c in self.chains if c.role != "side"] if joinable else self.chains
        hashes: list[int] = []
        if not pool:
            return None, 0, hashes
        level: list[Chain] = pool  # the chains sharing the first `depth` blocks with p
        depth = 0
        h = _SEED
        for k in range(len(p) // BLOCK):
            h = hash((h, p[k * BLOCK : (k + 1) * BLOCK].tobytes()))
            hashes.append(h)
            found = index.get(h)
            if not found:
                break
            level, depth = found, k + 1
        base = depth * BLOCK
        best, best_len = self._best(p, level, base)
        if base and best is not None and not _equal(p, best.tokens, 0, base):  # a collision
            best, best_len = self._best(p, pool, 0)
        return best, best_len, hashes

    @staticmethod
    def _best(p: array, candidates: Sequence[Chain], base: int) -> tuple[Chain | None, int]:
        """The most recent of the chains sharing the longest prefix with p. Newest first, and
        done at a chain holding all of p: a rollout that repeats one prompt (retries, GRPO-style
        samples in one rollout) then costs one comparison per call, not one per chain."""
        best, best_len = None, -1
        whole = len(p)
        for chain in reversed(candidates):
            n = _lcp(p, chain.tokens, base, min(whole, len(chain)))
            if n > best_len:  # ties: the most recent chain, seen first
                best, best_len = chain, n
                if n == whole:
                    break
        return best, max(best_len, 0)

    def _evidence(
        self,
        parent: Chain | None,
        lcp: int,
        p: array,
        purpose: str | None,
        has_chains: bool,
        request_json: str | None,
        agent: str | None = None,
    ) -> tuple[BreakEvidence, str | None, Parsed]:
        """The break's evidence, the call it diverged in, and this call's request if parsed."""
        if parent is None:
            return (
                BreakEvidence(purpose=purpose or "main", has_chains=has_chains, prompt_len=len(p)),
                None,
                None,
            )
        index, where = parent.locate(lcp)
        diverged_call = parent.calls[index].call_id if parent.calls else None
        mine: RequestView | None = None
        theirs: RequestView | None = None
        parsed: Parsed = None
        if has_chains and not is_side(purpose):
            mine, theirs = request_view(request_json), parent.request_view()
            parsed = (mine,)
        both = mine is not None and theirs is not None
        evidence = BreakEvidence(
            purpose=purpose or "main",
            has_chains=has_chains,
            prompt_len=len(p),
            lcp=lcp,
            parent_len=len(parent),
            parent_role=parent.role,
            diverged_in=where,
            system_changed=(mine.system != theirs.system) if both else None,
            tools_changed=(mine.tools != theirs.tools) if both else None,
            history=history_change(theirs.messages, mine.messages) if both else None,
            first_message_changed=(
                bool(mine.messages and theirs.messages) and mine.messages[0] != theirs.messages[0]
            )
            if both
            else None,
            compacted=(mine.summaries > theirs.summaries) if both else None,
            # a new top-level agent (another session) is no sign of a sub-agent; a spawned one is
            agent_changed=(
                agent != parent.agent
                if agent is not None and parent.agent is not None and parent_agent(agent)
                else None
            ),
        )
        return evidence, diverged_call, parsed


def _break_detail(
    parent: Chain | None, lcp: int, prompt_len: int, evidence: BreakEvidence, diverged: str | None
) -> dict[str, Any] | None:
    """The evidence of a break off `parent`, as the trace row's `break_detail` (None: no parent)."""
    if parent is None:
        return None
    return {
        "lcp": lcp,
        "prompt_len": prompt_len,
        "parent_len": len(parent),
        "diverged_in": evidence.diverged_in,
        "diverged_call_id": diverged,
        "system_changed": evidence.system_changed,
        "tools_changed": evidence.tools_changed,
        "history": evidence.history,
        "compacted": evidence.compacted,
        "agent_changed": evidence.agent_changed,
    }


def _role(reason: str, parent: Chain | None) -> str:
    if reason == SIDE_CALL:
        return "side"
    if reason == SUB_AGENT:
        return "sub"
    if reason == FIRST_CALL or parent is None:
        return "main"
    return parent.role


def _base(chain: Chain, shared: int) -> tuple[str, int, str | None] | None:
    """A chain's tokens are its last call's prompt + output ids (each call's prompt extends the
    chain before it), so a prompt sharing ``shared`` tokens with the chain shares them with that
    call: the base the store's delta encoding refers to."""
    if not chain.calls:
        return None
    return chain.calls[-1].call_id, min(shared, len(chain)), chain.last_request


def _aligned(logprobs: Sequence[float], k: int) -> array:
    """`k` float32 logprobs: the given ones, cut or padded with 0.0 (the record is then flagged
    `logprobs_misaligned` upstream of us, which makes the trace untrainable)."""
    if isinstance(logprobs, array) and logprobs.typecode == "f" and len(logprobs) == k:
        return logprobs
    values = array("f", [float(v) for v in list(logprobs)[:k]])
    if len(values) < k:
        values.frombytes(bytes(4 * (k - len(values))))
    return values
