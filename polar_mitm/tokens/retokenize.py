"""The no-ids fallback: recompute token ids with the policy tokenizer, verify, flag.

Some servers return no token ids: a plain OpenAI-compatible server (``polar_upstream_kind=openai``),
a vLLM older than 0.10.2, an SGLang from before PR #23751 — the last two ignore the token flags
silently. For their calls the record gets ids recomputed here:

* prompt ids: the request as the server saw it, normalized the way that kind of server normalizes
  it (:mod:`polar_mitm.tokens.conversation`), rendered with the policy tokenizer's chat template and
  tokenized, as the server itself would have done;
* output ids: the assistant reply appended to the conversation and rendered without a generation
  prompt; the text after the prompt's rendering is what the template says the model wrote (reasoning
  block, content, tool-call markup), tokenized and cut after the end-of-turn token (none when the
  reply was cut off by ``length``). Content before tool calls is stripped first: the whitespace
  between content and tool-call markup belongs to the template, and parsers that hand it back as
  content (vLLM's hermes) would otherwise get it rendered twice;
* both counts are checked against the server's ``usage``: ``count_check`` is ``ok`` only when both
  match. The record says ``ids_source = retokenized`` and carries the flag ``retokenized`` (plus
  ``prompt_count_mismatch`` / ``count_mismatch`` / ``retokenize_not_continuation``), with the
  figures in ``fidelity_json["retokenized"]``.

Retokenized ids are what the template *says*, not what was sampled (a real model can emit text that
tokenizes differently), so such records are never trainable unless ``polar_trust_retokenized`` is
set, and then only when both counts match and nothing else is flagged.

Rendering a long prompt takes milliseconds to tens of milliseconds, so it runs in a worker thread
after the harness already has its whole reply; the record reaches the sinks when it is done.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.record import CallRecord
from ..core.tasks import drain_tasks
from .conversation import RequestError, history_message, render_input
from .tokenizer import PolicyTokenizer

log = logging.getLogger("polar_mitm")
FLAG = "retokenized"


@dataclass(slots=True)
class RetokenizeJob:
    """One finished call whose reply lacked ids (some or all of them)."""

    record: CallRecord
    body: dict[str, Any]  # the chat-completions body sent upstream
    message: dict[str, Any]  # the assembled assistant reply
    flavor: str  # the server's normalization (`Upstream.template_flavor`)
    prompt_ids: list[int] | None = None  # from the server, when it sent them
    output_ids: list[int] | None = None


@dataclass(slots=True)
class RetokenizeResult:
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    continuation: bool = True  # the reply rendered as a continuation of the prompt's rendering
    error: str | None = None


@dataclass(slots=True)
class Retokenizer:
    """Recomputes ids for replies that carry none; one per proxy, shared by every call."""

    tokenizer: PolicyTokenizer
    trust: bool = False
    _pending: set[asyncio.Task] = field(default_factory=set)

    @property
    def _lock(self) -> threading.Lock:
        return self.tokenizer.lock  # shared with everyone else who drives the tokenizer

    @property
    def available(self) -> bool:
        return self.tokenizer.has_chat_template

    # -- scheduling ---------------------------------------------------------------------------

    def submit(self, job: RetokenizeJob, done: Callable[[], None]) -> None:
        """Retokenize off the event loop, fill the record, then call ``done`` (exactly once)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): do it inline
            apply_result(job, self.compute(job), self.trust)
            done()
            return
        task = loop.create_task(self._run(job, done))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run(self, job: RetokenizeJob, done: Callable[[], None]) -> None:
        result = RetokenizeResult(error="the proxy shut down before retokenizing")
        try:
            result = await asyncio.to_thread(self.compute, job)
        finally:
            apply_result(job, result, self.trust)
            done()

    async def drain(self) -> None:
        """Wait for every retokenization in flight (at shutdown)."""
        await drain_tasks(self._pending)

    # -- the work (blocking) --------------------------------------------------------------------

    def compute(self, job: RetokenizeJob) -> RetokenizeResult:
        try:
            return self._compute(job)
        except RequestError as e:
            return RetokenizeResult(error=f"cannot render the request: {e}")
        except Exception as e:  # a template or tokenizer failure must not lose the record
            return RetokenizeResult(error=f"retokenizing failed: {type(e).__name__}: {e}")

    def _compute(self, job: RetokenizeJob) -> RetokenizeResult:
        if not self.available:
            return RetokenizeResult(
                error=f"polar_tokenizer {self.tokenizer.spec} has no chat template"
            )
        inp = render_input(job.body, job.flavor)
        policy = self.tokenizer
        tok = policy.impl
        result = RetokenizeResult()
        with self._lock:
            prompt_text = policy.render(
                inp.messages,
                inp.tools,
                inp.kwargs,
                generation=inp.add_generation_prompt,
                continue_final=inp.continue_final_message,
            )
            if job.prompt_ids is None:
                result.prompt_ids = list(tok.encode(prompt_text, add_special_tokens=False))
            if job.output_ids is None:
                reply = history_message(job.flavor, _as_parsed(job.message))
                full_text = policy.render(
                    [*inp.messages, reply], inp.tools, inp.kwargs, generation=False
                )
                if full_text.startswith(prompt_text):
                    written = full_text[len(prompt_text) :]
                else:
                    result.continuation = False
                    written = full_text[_common_prefix(prompt_text, full_text) :]
                ids = list(tok.encode(written, add_special_tokens=False))
                result.output_ids = _cut_at_eos(ids, tok.eos_token_id, job.record.finish_reason)
        return result


def _as_parsed(message: dict[str, Any]) -> dict[str, Any]:
    """The reply with the whitespace around tool calls left to the template, as SGLang's parser
    gives it: content before tool calls stripped (none if only whitespace). Parsers that keep it
    (vLLM's hermes, streaming or not) return the template's own separators as content, and
    rendering them again would double them."""
    content = message.get("content")
    if message.get("tool_calls") and isinstance(content, str):
        return {**message, "content": content.strip() or None}
    return message


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cut_at_eos(ids: list[int], eos: int | None, finish_reason: str | None) -> list[int]:
    """The model's turn ends with the EOS it sampled; a ``length`` cut-off sampled none."""
    if eos is None:
        return ids
    ids = ids[: ids.index(eos) + 1] if eos in ids else [*ids, eos]
    if finish_reason == "length":
        ids = ids[:-1]
    return ids


def _check(count: int, usage: int | None) -> str:
    if usage is None:
        return "no_usage"
    return "ok" if count == usage else "mismatch"


def apply_result(job: RetokenizeJob, result: RetokenizeResult, trust: bool) -> None:
    """Fill the record from the result: ids, source, counts, flags, trainable."""
    record = job.record
    detail: dict[str, Any] = {"flavor": job.flavor}
    if result.error is not None:
        record.ids_source = "none"
        record.flag("missing_token_ids")
        record.flag("retokenize_failed")
        detail["error"] = result.error
        _put_fidelity(record, detail)
        record.trainable = False
        return
    parts = {
        "prompt": (job.prompt_ids, result.prompt_ids, record.usage_prompt_tokens),
        "output": (job.output_ids, result.output_ids, record.usage_completion_tokens),
    }
    checks = {}
    for name, (upstream, recomputed, usage) in parts.items():
        ids = upstream if upstream is not None else recomputed or []
        checks[name] = _check(len(ids), usage)
        detail[name] = {
            "source": "upstream" if upstream is not None else "retokenized",
            "tokens": len(ids),
            "usage": usage,
            "check": checks[name],
        }
        if name == "prompt":
            record.prompt_token_ids = ids
        else:
            record.output_token_ids = ids
    record.ids_source = "retokenized"
    record.flag(FLAG)
    if checks["prompt"] == "mismatch":
        record.flag("prompt_count_mismatch")
    if checks["output"] == "mismatch":
        record.flag("count_mismatch")
    if not result.continuation:
        record.flag("retokenize_not_continuation")
    detail["template_continuation"] = result.continuation
    if record.output_logprobs and len(record.output_logprobs) != len(record.output_token_ids):
        record.flag("logprobs_misaligned")
    values = set(checks.values())
    record.count_check = (
        "mismatch" if "mismatch" in values else "no_usage" if "no_usage" in values else "ok"
    )
    _put_fidelity(record, detail)
    record.trainable = (
        trust
        and record.status == "completed"
        and record.count_check == "ok"
        and set(record.fidelity_flags) <= {FLAG}
    )


def _put_fidelity(record: CallRecord, detail: Mapping[str, Any]) -> None:
    record.update_fidelity(**{FLAG: dict(detail)})
