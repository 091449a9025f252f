"""Exact-prefix mode (`polar_exact_prefix`): the policy is sampled on the tokens it sampled before.

In chat mode the server re-renders the whole conversation with its chat template on every call.
When the harness sends an earlier turn back differently from how the model wrote it (reasoning
dropped, tool arguments re-serialized, whitespace trimmed) or the template renders history
differently from a fresh turn (Qwen3 drops earlier reasoning), the policy is sampled on a prompt
that is not its own earlier output: the merge can only report that (`rerender`), not undo it.

Here the proxy builds the prompt itself. Each rollout keeps its chains: the conversation (one
key per message, `message_key`) and the exact tokens (prompt + sampled output, through the
end-of-turn token). A call whose messages start with a chain's messages — compared the way a
harness round-trips them: reasoning ignored, tool arguments compared as JSON values, content
whitespace trimmed — extends that chain: its prompt is the chain's tokens plus the tokenization of
only the new messages (tool results, a user turn), rendered with the policy tokenizer's chat
template as a continuation (`continuation_ids`). That prompt goes to the server's token-in endpoint
(`Upstream.token_in_body`), and the raw text coming back is parsed into the harness's dialect by
the model family's output parser (`call/token_in.py`). A call that extends no chain — the first call, a
side call, a compaction, a request the token-in endpoint cannot serve — goes the chat way, and the
record says why (`fidelity_json["exact_prefix"]`).

Matching and rendering run in a worker thread of their own; the event loop only snapshots a
rollout's chains and, when a call completes, appends or replaces one chain (`remember`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.record import CallRecord
from ..core.tasks import drain_tasks
from ..output_parsers import Family
from ..tokens.conversation import RenderInput, RequestError, history_message, render_input
from ..tokens.tokenizer import PolicyTokenizer
from .ids_json import IdsJson, ids_text, inner, joined

log = logging.getLogger("polar_mitm")

#: Stands in for the last assistant turn's content when the new messages are rendered: the
#: continuation starts right after the end-of-turn token that follows it.
SENTINEL = "\u2063polar-exact-prefix\u2063"
MAX_CHAINS = 32  # per rollout; the oldest goes first
MAX_ROLLOUTS = 4096  # rollouts with chains in memory; the least recently used goes first
# Chat-request fields a token-in request cannot honour (constrained decoding, several choices):
# such calls go the chat way.
_CHAT_ONLY = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Sampling parameters passed on to the token-in request under the same names.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


# One encoder each, built once: `json.dumps` with arguments builds a new JSONEncoder per call (the
# same text, byte for byte).
_SORTED = json.JSONEncoder(ensure_ascii=False, sort_keys=True, default=str)
_PLAIN = json.JSONEncoder(default=str)


def message_key(message: Mapping[str, Any]) -> bytes:
    """A message as far as "the harness sent it back unchanged" goes: role, trimmed text, tool
    calls by name and argument value. Reasoning and tool-call ids are left out on purpose: a
    harness that drops them still sent the same turn, and the chain has the sampled tokens."""
    role = message.get("role")
    content = message.get("content")
    if content is None:
        content = ""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append([function.get("name"), arguments])
    if role == "assistant":
        text = text.strip()
    # The text is hashed as it is, not as JSON: a request re-sends every earlier message on every
    # call (a long session's last call hashes 240k characters), and escaping that text into a JSON
    # string cost five times the hashing. Each part is length-prefixed, so no two messages share
    # a byte stream.
    h = hashlib.blake2b(digest_size=16)
    for part in (
        _PLAIN.encode(role).encode(),
        text.encode("utf-8", "surrogatepass"),
        _SORTED.encode(calls).encode("utf-8", "surrogatepass") if calls else b"",
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _context_key(inp: RenderInput) -> str:
    blob = _SORTED.encode([inp.tools, inp.kwargs])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Chain:
    """One chain of a rollout as the policy sampled it. Immutable: a longer one replaces it."""

    context: str  # tools + template variables: a different one is another prompt altogether
    keys: tuple[bytes, ...]  # message keys: the request's messages, then the reply
    tokens: array  # prompt + output ids, exactly as sampled
    eos_text: str | None  # the text of the end-of-turn token the output ended with, if it did
    last_assistant: dict[str, Any]
    last_call_id: str


@dataclass(slots=True)
class ExactPlan:
    """A call that extends a chain: what to send to the token-in endpoint."""

    prompt_ids: array  # int32: the chain's tokens, then the new messages
    prompt_json: bytes  # the same as a JSON list, the request's text (`ids_json`)
    chain_tokens: int  # how many of them are the chain's
    extends_call: str  # the chain's last call
    sampling: dict[str, Any]
    parse_tools: bool
    thinking_enabled: bool
    reasoning_open: bool | None


@dataclass(slots=True)
class Lookup:
    """What the lookup learned of one call; kept on the call until it completes."""

    context: str | None = None
    keys: tuple[bytes, ...] = ()
    plan: ExactPlan | None = None
    reason: str | None = None  # why the call goes the chat way

    def note(self) -> dict[str, Any]:
        if self.plan is None:
            return {"path": "chat", "reason": self.reason}
        return {
            "path": "token_in",
            "chain_tokens": self.plan.chain_tokens,
            "new_tokens": len(self.plan.prompt_ids) - self.plan.chain_tokens,
            "extends_call": self.plan.extends_call,
        }


class NotContinuation(Exception):
    """The template does not render the new messages after an end-of-turn token."""


@dataclass
class ExactPrefix:
    """The chains of every rollout, and the prompt of a call that extends one."""

    tokenizer: PolicyTokenizer
    family: Family
    flavor: str = "vllm"  # how the server normalizes messages (`Upstream.template_flavor`)
    _rollouts: OrderedDict[str, list[Chain]] = field(default_factory=OrderedDict)
    _special_text: dict[int, str] = field(default_factory=dict)
    texts: IdsJson = field(default_factory=IdsJson)  # chains' ids as JSON text (a cache)
    compare_calls: bool = False  # polar_exact_compare: what chat mode would have sent, per call
    token_in: str = "completions"  # polar_token_in: vLLM's token-in route (call/exchange.py)
    _pending: set[asyncio.Task] = field(default_factory=set)
    # One thread of its own: a plan renders and tokenizes under the tokenizer's lock anyway, and
    # the default executor's threads (each with a malloc arena holding its freed request copies)
    # cost memory for no parallelism.
    _worker: concurrent.futures.ThreadPoolExecutor | None = None

    def __post_init__(self) -> None:
        self._special_text = {i: text for text, i in self.tokenizer.specials.items()}

    # -- the lookup (worker thread) -----------------------------------------------------------

    async def lookup(
        self, rollout_id: str, chat: dict[str, Any], max_model_len: int | None
    ) -> Lookup:
        chains = tuple(self._rollouts.get(rollout_id, ()))  # a snapshot: chains are immutable
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, "polar-exact")
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._worker, self.plan, chains, chat, max_model_len)
        except Exception as e:  # a bug here must not fail the call: it goes the chat way
            log.exception("polar-mitm: exact-prefix lookup failed")
            return Lookup(reason=f"lookup_failed: {type(e).__name__}: {e}")

    def plan(
        self, chains: Sequence[Chain], chat: dict[str, Any], max_model_len: int | None
    ) -> Lookup:
        try:
            inp = render_input(chat, self.flavor)
        except RequestError as e:
            return Lookup(reason=f"unrenderable: {e}")
        found = Lookup(_context_key(inp), tuple(message_key(m) for m in inp.messages))
        unsupported = _unsupported(chat, inp)
        best: Chain | None = None
        for chain in chains:
            n = len(chain.keys)
            if (
                chain.context == found.context
                and n < len(found.keys)
                and found.keys[:n] == chain.keys
                and (best is None or n > len(best.keys))
            ):
                best = chain
        if best is None:
            found.reason = "no_chain"
            return found
        if unsupported:
            found.reason = unsupported
            return found
        tail = inp.messages[len(best.keys) :]
        if any(m.get("role") == "assistant" for m in tail):
            found.reason = "new_assistant_turn"  # not sampled here: let the template render it
            return found
        if best.eos_text is None:
            found.reason = "chain_not_closed"  # the last output was cut off (length, stop string)
            return found
        try:
            new = self.continuation_ids(inp, best, tail)
        except NotContinuation:
            found.reason = "template_not_continuation"
            return found
        prompt = best.tokens + array("i", new)  # two memcpys: a long chain is 100k ids
        prompt_json = joined(self.texts.of(best.last_call_id, best.tokens), ids_text(new))
        cap = chat.get("max_completion_tokens") or chat.get("max_tokens")
        if max_model_len is not None:
            room = max_model_len - len(prompt)
            if room < 1:
                found.reason = "context_full"  # the server refuses it in its own words
                return found
            cap = min(cap, room) if isinstance(cap, int) and cap > 0 else room
        elif not isinstance(cap, int) or cap < 1:
            found.reason = "max_model_len_unknown"  # a token-in cap must be explicit
            return found
        sampling = {k: chat[k] for k in SAMPLING_KEYS if chat.get(k) is not None}
        sampling["max_tokens"] = cap
        found.plan = ExactPlan(
            prompt_ids=prompt,
            prompt_json=prompt_json,
            chain_tokens=len(best.tokens),
            extends_call=best.last_call_id,
            sampling=sampling,
            parse_tools=bool(inp.tools) and chat.get("tool_choice") != "none",
            thinking_enabled=inp.kwargs.get("enable_thinking", True) is not False,
            reasoning_open=self.family.reasoning_open_at_end(self.tokenizer.specials, prompt),
        )
        return found

    def continuation_ids(
        self, inp: RenderInput, chain: Chain, tail: Sequence[dict[str, Any]]
    ) -> list[int]:
        """The new messages' tokens as the template renders them after the chain's last turn.

        The conversation is rendered with a stand-in for everything before: the leading system
        messages, one user turn, the chain's last assistant turn with `SENTINEL` as its content,
        then the new messages and the generation prompt. The continuation is the text after the
        first end-of-turn token past the sentinel, tokenized on its own: it starts right after a
        special token, so it tokenizes as it would inside the whole rendering."""
        lead = []
        for message in inp.messages:
            if message.get("role") not in ("system", "developer"):
                break
            lead.append(message)
        stand_in = {**chain.last_assistant, "content": SENTINEL}
        messages = [*lead, {"role": "user", "content": "."}, stand_in, *tail]
        tok = self.tokenizer
        with tok.lock:
            text = tok.render(messages, inp.tools, inp.kwargs)
        eos = chain.eos_text or ""
        at = text.find(SENTINEL)
        end = text.find(eos, at + len(SENTINEL)) if at >= 0 and eos else -1
        if end < 0:
            raise NotContinuation()
        with tok.lock:
            return tok.encode(text[end + len(eos) :])

    # -- chains (event loop) --------------------------------------------------------------------

    def remember(
        self,
        rollout_id: str,
        lookup: Lookup,
        reply: Mapping[str, Any],
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        call_id: str,
    ) -> None:
        """A completed call's conversation and tokens become a chain of its rollout (replacing
        the one it extended). Called before the harness has the end of the reply, so its next
        call finds the chain."""
        if lookup.context is None or not output_ids:
            return
        assistant = history_message(self.flavor, reply)
        tokens = array("i", prompt_ids)
        tokens.extend(output_ids)
        chain = Chain(
            context=lookup.context,
            keys=(*lookup.keys, message_key(assistant)),
            tokens=tokens,
            eos_text=self._special_text.get(int(output_ids[-1])),
            last_assistant=assistant,
            last_call_id=call_id,
        )
        if lookup.plan is not None and len(prompt_ids) == len(lookup.plan.prompt_ids):
            # what the next call sends: this one's prompt text as sent, then its output
            sent = memoryview(lookup.plan.prompt_json)[1:-1]  # no copy: `inner` makes the one
            self.texts.put(call_id, inner(sent, ids_text(output_ids)))
        chains = self._rollouts.pop(rollout_id, None) or []
        n = len(lookup.keys)
        kept, replaced = [], []
        for c in chains:
            extended = (
                c.context == chain.context
                and c.keys == chain.keys[: len(c.keys)]
                and len(c.keys) <= n
            )
            (replaced if extended else kept).append(c)
        kept.append(chain)
        replaced += kept[:-MAX_CHAINS]
        self._rollouts[rollout_id] = kept[-MAX_CHAINS:]
        while len(self._rollouts) > MAX_ROLLOUTS:
            replaced += self._rollouts.popitem(last=False)[1]
        self.texts.drop(c.last_call_id for c in replaced)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def forget(self, rollout_id: str) -> None:
        self.texts.drop(c.last_call_id for c in self._rollouts.pop(rollout_id, ()))

    def chains(self, rollout_id: str) -> list[Chain]:
        return list(self._rollouts.get(rollout_id, ()))

    # -- what chat mode would have sent (`polar_exact_compare`: a worker, before the record is
    # stored) ------------------------------------------------------------------------------------

    def chat_prompt_ids(self, chat: dict[str, Any]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self.flavor, chat)

    def compare(self, record: CallRecord, chat: dict[str, Any], note: dict[str, Any]) -> None:
        """Put on the record what chat mode would have sent, against what was sent: the drift
        exact-prefix mode removed (`fidelity_json["exact_prefix"]`)."""
        try:
            would = self.chat_prompt_ids(chat)
        except Exception as e:
            note["chat_prompt_error"] = f"{type(e).__name__}: {e}"
        else:
            note.update(prompt_drift(record.prompt_token_ids or (), would))
        put_note(record, note)

    def submit(
        self,
        record: CallRecord,
        chat: dict[str, Any],
        note: dict[str, Any],
        done: Callable[[], None],
    ) -> None:
        """`compare` off the event loop, then `done` (the record's delivery), exactly once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.compare(record, chat, note)
            done()
            return

        async def run() -> None:
            try:
                await asyncio.to_thread(self.compare, record, chat, note)
            except Exception as e:
                note["chat_prompt_error"] = f"{type(e).__name__}: {e}"
                put_note(record, note)
            finally:
                done()

        task = loop.create_task(run())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        await drain_tasks(self._pending)


def chat_prompt_ids(tok: PolicyTokenizer, flavor: str, chat: dict[str, Any]) -> list[int]:
    """The prompt ids chat mode would have had: the whole conversation rendered with the chat
    template and tokenized. O(conversation): a long session's last call is 80k tokens, a quarter
    of a second of tokenizing, so the proxy does it only with `polar_exact_compare`."""
    inp = render_input(chat, flavor)
    with tok.lock:
        text = tok.render(inp.messages, inp.tools, inp.kwargs, generation=inp.add_generation_prompt)
        return tok.encode(text)


def prompt_drift(sent: Sequence[int], would: Sequence[int]) -> dict[str, Any]:
    """How a token-in prompt differs from chat mode's: `first_diff` (None: identical) and
    `drift_tokens`, the sampled and environment tokens from there on: what a chat-mode prompt
    would have changed under the policy."""
    first = next((i for i, (a, b) in enumerate(zip(sent, would, strict=False)) if a != b), None)
    if first is None and len(sent) != len(would):
        first = min(len(sent), len(would))
    return {
        "chat_prompt_tokens": len(would),
        "first_diff": first,
        "drift_tokens": 0 if first is None else len(sent) - first,
    }


def put_note(record: CallRecord, note: dict[str, Any]) -> None:
    """`fidelity_json["exact_prefix"]` on the record (other keys kept)."""
    record.update_fidelity(exact_prefix=note)


def _unsupported(chat: Mapping[str, Any], inp: RenderInput) -> str | None:
    """Why a token-in request cannot stand in for this chat request (None when it can)."""
    for key in _CHAT_ONLY:
        if chat.get(key) is not None:
            return f"chat_only_field: {key}"
    if chat.get("n") not in (None, 1):
        return "n_choices"
    choice = chat.get("tool_choice")
    if isinstance(choice, Mapping) or choice == "required":
        return "forced_tool_choice"  # the chat endpoint constrains decoding for these
    if inp.continue_final_message or not inp.add_generation_prompt:
        return "no_generation_prompt"
    return None
