"""One captured LLM call, from the upstream request to the finished record.

The harness's request has been parsed by its dialect; `Call.run` sends the chat-completions body
to the policy server, moves the token fields into the record as they arrive, and writes the
harness's reply to an `Output` while it streams. Every way a call can end — reply complete,
upstream error, upstream gone mid-stream, harness gone — ends in exactly one `finish`, so each
call leaves one record, and the harness always gets a well-formed answer in its own dialect.

Over 500 lines because `Call` is one call's state machine: every way a call can end (reply
complete, upstream error, upstream gone mid-stream, harness gone) runs through its one
`finish`, and keeping all those paths in one class is what lets a reader check "exactly one
record per call" in one file. Wire parsing is in `core/sse.py`, the dialects and `upstream/`;
what the harness is told of a failure, in `failures.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

import aiohttp
import msgspec

from ..core import fastjson
from ..core.record import CallRecord, CallSink, deliver, now_us
from ..core.redaction import redacted_json
from ..core.sse import SSEParser
from ..dialects import Dialect, HarnessRequest, StreamTranslator
from ..dialects.assemble import ChatAssembler, reply_to_chunks
from ..tokens.retokenize import RetokenizeJob, Retokenizer
from ..trajectory.exact_prefix import ExactPlan, ExactPrefix, Lookup, put_note
from ..upstream import TokenTally, Upstream
from ..upstream.constraints import PASS, ThinkMarkers, note_constraints, upstream_chat
from ..upstream.vllm import GENERATE_FIX, VLLM
from .failures import (
    MALFORMED,
    UpstreamFailed,
    cap_refused,
    clean,
    error_message,
    failure_of,
    json_chunk,
    json_value,
    malformed,
    read_error,
)
from .token_in import TokenInReply

log = logging.getLogger(__name__)
# How long a completed reply's last bytes wait for the record to be durable (see `_durable`):
# far above a journal fsync (~1 ms), low enough that a failing disk only slows harnesses down.
DURABLE_WAIT_S = 10.0


class ClientGone(Exception):
    """The harness closed its connection before the reply was complete."""


class Output(Protocol):
    """Where the harness's reply goes (the gateway's HTTP response)."""

    @property
    def started(self) -> bool: ...

    async def start(self, status: int, content_type: str) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes) -> None:
        """Write the last bytes and end the body, in one write rather than two."""
        ...

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None: ...


@dataclass(slots=True)
class UpstreamSettings:
    upstream: Upstream
    model: str | None
    _: KW_ONLY
    connect_timeout: float = 10.0
    stall_timeout: float = 300.0
    retokenizer: Retokenizer | None = None  # the no-ids fallback, when polar_tokenizer allows it
    exact: ExactPrefix | None = None  # polar_exact_prefix: chains and token-in prompts
    max_model_len: int | None = None  # from the server's GET /v1/models (token-in output caps)
    harness_constraints: str = PASS  # polar_harness_constraints (upstream/constraints.py)
    think_markers: ThinkMarkers | None = None  # from polar_tokenizer: where a grammar starts
    buffer_replies: bool = False  # polar_upstream_stream=buffer: the upstream never streams
    stream_interval: int = 1  # polar_stream_interval: tokens per upstream chunk (vLLM)


_JSON = {"content-type": "application/json"}


class Call:
    def __init__(
        self,
        record: CallRecord,
        dialect: Dialect,
        req: HarnessRequest,
        *,
        settings: UpstreamSettings,
        sinks: Sequence[CallSink],
        secrets: Sequence[str] = (),
        on_done: Callable[[Call], None] | None = None,
    ) -> None:
        self.record = record
        self.dialect = dialect
        self.req = req
        self.settings = settings
        self.sinks = sinks
        self.secrets = secrets
        self.on_done = on_done
        self.tally = TokenTally()
        self.assembler = ChatAssembler()
        self.upstream_body: dict[str, Any] | None = None
        # The harness's stream, kept so that a failure ends the very stream it started.
        self.translator: StreamTranslator | None = None
        # Exact-prefix mode: what the chain lookup found, and the token-in reply's converter.
        self.lookup: Lookup | None = None
        self.text_reply: TokenInReply | None = None
        self.task: asyncio.Task | None = None
        self.hide_reasoning = False  # the harness sent include_reasoning: false
        self._finished = False
        self._abort = ("client_aborted", "the harness closed the connection")
        self._receipts: list[Any] = []  # from the sinks: done once the record is durable
        # when the upstream request went out and its first body bytes came (µs): the
        # upstream's own time to first byte, for the added-latency metric (metrics.py)
        self.upstream_sent_at: int | None = None
        self.upstream_first_at: int | None = None
        # told how long a completed reply's end waited for its record to be durable (`_durable`)
        self.on_hold: Callable[[int], None] | None = None

    # -- driving the call -------------------------------------------------------------------

    async def run(self, out: Output, session: aiohttp.ClientSession) -> None:
        """The call, start to finish: the chain lookup (exact-prefix mode), the upstream request,
        the reply relayed to `out`; every failure is answered and ends in `finish`."""
        self.task = asyncio.current_task()
        if self.settings.exact is not None and self.settings.upstream.token_in_path:
            try:
                await self._look_up()
            except asyncio.CancelledError:  # the harness left (or shutdown) during the lookup
                self.finish(*self._abort)
                raise
        self.hide_reasoning = self.req.chat.get("include_reasoning") is False
        url, body, stream_upstream = self._request()
        try:
            await self._send(out, session, url, body, stream_upstream)
        except ClientGone:
            self.finish("client_aborted", "the harness closed the connection mid-reply")
        except asyncio.CancelledError:
            self.finish(*self._abort)
            raise
        except Exception as e:
            s = self.settings
            failure = failure_of(e, s.upstream.base_url, s.connect_timeout, self._stall_message())
            if failure is None:  # a bug of ours must still answer and leave a record
                log.exception("polar-mitm: call %s failed", self.record.call_id)
                failure = UpstreamFailed(f"polar-mitm internal error: {e}", 500)
            await self._answer_error(out, failure)

    async def _look_up(self) -> None:
        """Exact-prefix mode: the rollout's chain this call extends, and the token-in plan (none
        when the upstream cannot send its sampling parameters)."""
        assert self.settings.exact is not None
        self.lookup = await self.settings.exact.lookup(
            self.record.rollout_id, self.req.chat, self.settings.max_model_len
        )
        plan = self.lookup.plan
        if plan is not None:
            unsupported = self.settings.upstream.token_in_unsupported(plan.sampling)
            if unsupported:  # e.g. a sampling parameter SGLang's /generate has no name for
                self.lookup.plan, self.lookup.reason = None, unsupported

    def _request(self) -> tuple[str, dict[str, Any], bool]:
        """The upstream request: its URL, its body, and whether it streams. Token-in (a plan)
        or chat completions."""
        upstream = self.settings.upstream
        model = self.settings.model or self.req.model or None
        plan = self.lookup.plan if self.lookup is not None else None
        buffer = self.settings.buffer_replies
        if plan is not None:
            return self._token_in_request(plan, model)
        stream_upstream = self.req.stream and upstream.streams_with_tokens and not buffer
        body = upstream.request_body(
            upstream_chat(
                self.req.chat, self.settings.harness_constraints, self.record.translation_notes
            ),
            model=model,
            stream=stream_upstream,
            top_logprobs=self.req.top_logprobs,
        )
        # vLLM drops token_ids and logprobs from a reply with include_reasoning false (with a
        # reasoning parser loaded): never forward it (the harness's reply loses the reasoning
        # here instead, see hide_reasoning).
        body.pop("include_reasoning", None)
        self.record.model_served = body.get("model")
        self.upstream_body = self._chunked(body, stream_upstream)
        return upstream.chat_url, body, stream_upstream

    def _token_in_request(self, plan: ExactPlan, model: str | None) -> tuple[str, Any, bool]:
        """The token-in request of a plan: vLLM's /inference/v1/generate (polar_token_in=generate;
        whole, and not with stop strings: those need the server's detokenizer), else the
        upstream's token-in endpoint."""
        upstream, exact = self.settings.upstream, self.settings.exact
        assert exact is not None
        prompt = msgspec.Raw(plan.prompt_json)
        generate = (
            exact.token_in == "generate"
            and isinstance(upstream, VLLM)
            and not plan.sampling.get("stop")
        )
        if generate:
            assert isinstance(upstream, VLLM)
            stream_upstream = False
            body = upstream.generate_body(prompt, plan.sampling, model=model)
            url = upstream.generate_url
        else:
            buffer = self.settings.buffer_replies
            stream_upstream = self.req.stream and upstream.token_in_streams and not buffer
            body = upstream.token_in_body(
                prompt, plan.sampling, model=model, stream=stream_upstream
            )
            url = upstream.token_in_url
        self.record.route = "token_in"
        self.tally.prompt_ids = plan.prompt_ids  # what was sent (the server echoes nothing)
        self.text_reply = TokenInReply(
            upstream,
            plan,
            family=exact.family,
            tokenizer=exact.tokenizer,
            tally=self.tally,
            model=model,
            wants_logprobs=self.req.wants_logprobs,
            generate=generate,
        )
        self.record.model_served = model
        self.upstream_body = self._chunked(body, stream_upstream)
        return url, body, stream_upstream

    def _chunked(self, body: dict[str, Any], stream_upstream: bool) -> dict[str, Any]:
        """polar_stream_interval: a streamed request asks a server that takes it for that many
        tokens a chunk (the relay's cost is per chunk, upstream and here)."""
        interval = self.settings.stream_interval
        if stream_upstream and interval > 1 and self.settings.upstream.takes_stream_interval:
            body["stream_interval"] = interval
        return body

    async def _send(
        self,
        out: Output,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        stream_upstream: bool,
    ) -> None:
        """Post the request and relay the reply; once more without the output cap when the
        server refused it (`_drop_output_cap`)."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(
            total=None, connect=s.connect_timeout, sock_read=s.stall_timeout
        )
        for retry in (False, True):
            data = fastjson.dumps_bytes(body)  # once per try: a retry changes the body
            self.upstream_sent_at = now_us()
            async with session.post(url, data=data, headers=_JSON, timeout=timeout) as resp:
                if resp.status != 200:
                    failure = await read_error(resp, s.upstream.base_url, self.record.model_served)
                    if self.text_reply is not None and self.text_reply.generate:
                        generate_refused(failure, resp.status)
                    if not retry and self._drop_output_cap(resp.status, failure, body):
                        continue
                    raise failure
                if stream_upstream:
                    await self._relay_stream(resp, out)
                else:
                    await self._relay_reply(resp, out)
                return

    async def _relay_stream(self, resp: aiohttp.ClientResponse, out: Output) -> None:
        translator = self.translator = self.dialect.stream(self.req)
        parser = SSEParser()
        upstream = self.settings.upstream
        await out.start(200, translator.content_type)
        done = False
        async for data in resp.content.iter_any():
            if self.upstream_first_at is None:
                self.upstream_first_at = now_us()
            pieces = []
            try:
                for event in parser.feed(data):
                    if event.data == "[DONE]":
                        done = True
                        break
                    chunk = json_chunk(event.data)
                    usage = chunk.get("usage")
                    if usage is not None and type(usage) is not dict:
                        raise TypeError(f"usage is {type(usage).__name__}, not an object")
                    if chunk.get("error"):  # vLLM's mid-stream failure (SDKs raise on it)
                        message = clean(error_message(chunk) or event.data[:1000])
                        raise UpstreamFailed(f"upstream error mid-stream: {message}")
                    if self.text_reply is None:
                        upstream.take_chunk(chunk, self.tally)
                        if self.tally.finish_reason == "abort":  # before the harness sees it
                            self._check_abort()
                        chunks: Sequence[dict[str, Any]] = (chunk,)
                    else:  # token-in: raw text, parsed into what the chat endpoint sends
                        chunks = self.text_reply.chunks(chunk)
                    if translator.prompt_tokens is None and self.tally.prompt_ids is not None:
                        translator.prompt_tokens = len(self.tally.prompt_ids)
                    for chunk in chunks:
                        self.assembler.feed(chunk)
                        if self.hide_reasoning:
                            chunk = _without_reasoning(chunk)
                        piece = translator.chunk(chunk)
                        if piece:
                            pieces.append(piece)
            except MALFORMED as e:
                raise malformed(e) from None
            if pieces:
                await self._write(out, b"".join(pieces))
            if done:
                break
        if self.tally.finish_reason is None:
            how = "without a finish_reason" if done else "before it was complete"
            raise UpstreamFailed(f"upstream {upstream.base_url} ended the stream {how}")
        self._check_abort()
        try:
            tail = translator.finish()
        except MALFORMED as e:  # what the dialect builds at the end from what the chunks said
            raise malformed(e, "a stream") from None
        await self._complete(out, tail)

    async def _relay_reply(self, resp: aiohttp.ClientResponse, out: Output) -> None:
        try:
            raw = await resp.read()
            self.upstream_first_at = now_us()
            reply = json_value(raw.decode("utf-8"), "reply")
        except (UnicodeDecodeError, RecursionError, ValueError) as e:
            raise UpstreamFailed(f"upstream reply is not valid JSON: {e}") from None
        if self.text_reply is not None:  # token-in: raw text, parsed as the chat endpoint would
            if not isinstance(reply, dict):
                raise UpstreamFailed("upstream token-in reply is not a JSON object")
            try:
                reply = self.text_reply.reply(reply)
            except MALFORMED as e:
                raise malformed(e, "a token-in reply") from None
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or not choices:
            raise UpstreamFailed("upstream reply is not a chat completion (no choices)")
        if not isinstance(choices[0], dict) or not isinstance(choices[0].get("message"), dict):
            raise UpstreamFailed("upstream reply is not a chat completion (no message)")
        if reply.get("usage") is not None and type(reply["usage"]) is not dict:
            raise UpstreamFailed("upstream reply's usage is not an object")
        try:
            if self.text_reply is None:
                self.settings.upstream.take_reply(reply, self.tally)
            if self.tally.finish_reason is None:
                raise UpstreamFailed("upstream reply has no finish_reason")
            self._check_abort()
            if self.req.stream:  # the server cannot stream with token flags: synthesize it
                translator = self.translator = self.dialect.stream(self.req)
                if self.tally.prompt_ids is not None:
                    translator.prompt_tokens = len(self.tally.prompt_ids)
                pieces = []
                for chunk in reply_to_chunks(reply):
                    self.assembler.feed(chunk)
                    if self.hide_reasoning:
                        chunk = _without_reasoning(chunk)
                    pieces.append(translator.chunk(chunk))
                body, tail = b"".join(pieces), translator.finish()
            else:
                self.assembler.feed(reply)
                if self.hide_reasoning:
                    reply = _without_reasoning(reply)
                body = json.dumps(self.dialect.reply(self.req, reply), ensure_ascii=False).encode()
        except MALFORMED as e:
            raise malformed(e, "a reply") from None
        if self.req.stream:
            await out.start(200, translator.content_type)
            await self._write(out, body)
            await self._complete(out, tail)
        else:
            self.record.mark_first_byte()
            # send() only sets the response: the gateway writes it after run() returns, so
            # the whole body is what waits for the record here.
            await out.send(200, body)
            self.finish("completed")
            await self._durable()

    def _check_abort(self) -> None:
        """SGLang ends an aborted generation with finish reason ``abort`` and HTTP 200: not a
        reply, an error for the harness (and the record), never a ``stop``."""
        if self.tally.finish_reason == "abort":
            why = self.tally.abort_message or "no reason given"
            raise UpstreamFailed(
                f"upstream {self.settings.upstream.base_url} aborted the generation: {why}"
            )

    async def _complete(self, out: Output, final: bytes) -> None:
        """End a completed stream: the record first, then (once it is durable) the last bytes.

        The harness takes a reply as complete only on its last event (``data: [DONE]``,
        ``message_stop``, ``response.completed``), so holding that event until the record is in
        the journal means a reply the harness saw complete is never lost to a crash. The other
        way round is harmless: a record of a finished generation whose last event never arrived.
        """
        self.finish("completed")
        await self._durable()
        await out.end(final)
        if final:
            self.record.mark_first_byte()

    async def _durable(self) -> None:
        """Wait (bounded) for the sinks' receipts: the record is durable once they are done."""
        receipts, self._receipts = self._receipts, []
        if not receipts:
            return
        waits = [
            asyncio.wrap_future(r) if isinstance(r, concurrent.futures.Future) else r
            for r in receipts
        ]
        began = now_us()
        try:
            await asyncio.wait_for(asyncio.gather(*waits), DURABLE_WAIT_S)
            if self.on_hold is not None:
                self.on_hold(now_us() - began)
        except TimeoutError:
            log.warning(
                "polar-mitm: call %s: the record is not durable after %gs (journal stuck?); "
                "sending the end of the reply anyway",
                self.record.call_id,
                DURABLE_WAIT_S,
            )
        except Exception as e:  # a sink's failure must not keep the harness waiting
            log.warning(
                "polar-mitm: call %s: durability receipt failed: %s", self.record.call_id, e
            )

    async def _write(self, out: Output, data: bytes) -> None:
        if data:
            await out.write(data)
            self.record.mark_first_byte()

    def _drop_output_cap(self, status: int, failure: UpstreamFailed, body: dict[str, Any]) -> bool:
        """The harness's output cap is an upper bound (Claude Code asks up to 128000), but vLLM
        0.33 refuses one above the whole context, and older vLLM and SGLang one that does not fit
        beside the prompt. Without the cap they generate to the end of the context, which is less
        than the cap, so sending it again without one is the clamp the harness meant. A prompt
        too long by itself is not resent: the harness gets the refusal at once."""
        if status != 400 or not cap_refused(failure.message):
            return False
        if self.text_reply is not None:  # token-in caps are clamped already; none means 16
            return False
        caps = [key for key in ("max_tokens", "max_completion_tokens") if key in body]
        if not caps:
            return False
        for key in caps:
            cap = body.pop(key)
        self.record.translation_notes.append(
            f"{caps[0]}={cap} dropped: the server refused it as it exceeds the model's context "
            "(alone or beside the prompt)"
        )
        return True

    async def _answer_error(self, out: Output, e: UpstreamFailed) -> None:
        # http_status is what the harness got: a stream already under way stays a 200 and ends
        # with the dialect's error event.
        self.record.http_status = 200 if out.started else e.status
        try:
            if out.started:
                translator = self.translator or self.dialect.stream(self.req)
                await out.write(translator.fail(e.message, e.kind))
            elif e.headers:
                body = self.dialect.error_bytes(e.status, e.message, e.kind)
                await out.send(e.status, body, headers=e.headers)
            else:
                await out.send(e.status, self.dialect.error_bytes(e.status, e.message, e.kind))
        except ClientGone:
            pass
        self.finish("error", e.message)

    def _stall_message(self) -> str:
        s = self.settings
        where = (
            "mid-stream" if self.tally.output_ids or self.assembler.content else "before replying"
        )
        return f"upstream {s.upstream.base_url} sent nothing for {s.stall_timeout:g}s {where}"

    # -- the record -------------------------------------------------------------------------

    def finish(self, status: str, error: str | None = None) -> None:
        """Complete the record exactly once and hand it to every sink."""
        if self._finished:
            return
        self._finished = True
        record = self.record
        try:
            job = self._fill(status, error)
        except Exception as e:  # a bug of ours must still leave a record
            log.exception("polar-mitm: call %s: cannot complete its record", record.call_id)
            job = None
            record.status = "error"
            record.error = (
                f"{error or status}; polar-mitm internal error completing the record: {e}"
            )
            record.trainable = False
            record.flag("record_incomplete")
        exact, lookup = self.settings.exact, self.lookup
        if exact is not None and lookup is not None:
            try:
                self._exact_done(exact, lookup)
            except Exception:  # the chain is lost, the record must not be
                log.exception(
                    "polar-mitm: call %s: exact-prefix bookkeeping failed", record.call_id
                )
        if job is not None:
            # Not held for: the record needs the retokenizer first, the harness does not.
            assert self.settings.retokenizer is not None
            self.settings.retokenizer.submit(job, lambda: deliver(record, self.sinks))
        elif exact is not None and exact.compare_calls and lookup is not None and lookup.plan:
            # polar_exact_compare (not held for): what chat mode would have sent, off the loop
            note = lookup.note()
            exact.submit(record, self.req.chat, note, lambda: deliver(record, self.sinks))
        else:
            self._receipts = deliver(record, self.sinks)
        if self.on_done is not None:
            self.on_done(self)

    def _exact_done(self, exact: ExactPrefix, lookup: Lookup) -> None:
        """Exact-prefix mode: a completed call becomes its rollout's chain (before the harness
        has the end of the reply, so its next call finds it); the record says which path."""
        record, plan = self.record, lookup.plan
        counted = record.usage_prompt_tokens
        if plan is not None and counted is not None and counted != len(plan.prompt_ids):
            # the server ran another prompt than the ids sent (it prepended a BOS, or a proxy in
            # between retokenized): it does not echo them, but it counts them
            record.flag("prompt_echo_mismatch")
        put_note(record, lookup.note())
        if record.status == "completed" and record.ids_source == "upstream":
            exact.remember(
                record.rollout_id,
                lookup,
                self.assembler.message(),
                record.prompt_token_ids or (),
                record.output_token_ids,
                record.call_id,
            )

    def _fill(self, status: str, error: str | None) -> RetokenizeJob | None:
        """Fill the record from the tally; the no-ids fallback's job when it must retokenize."""
        record, tally = self.record, self.tally
        record.finished_at = now_us()
        record.status = status
        record.error = error
        if record.http_status is None:
            record.http_status = 200 if status != "error" else 502
        record.prompt_token_ids = _int32_array(tally.prompt_ids)
        record.output_token_ids = tally.output_ids
        record.output_logprobs = tally.logprobs
        record.finish_reason = tally.finish_reason or self.assembler.finish_reason
        record.model_served = tally.model or record.model_served
        if not isinstance(tally.usage, dict):
            tally.usage = None
        if tally.usage:
            record.usage_json = json.dumps(tally.usage)
            record.usage_prompt_tokens = _int_or_none(tally.usage.get("prompt_tokens"))
            record.usage_completion_tokens = _int_or_none(tally.usage.get("completion_tokens"))
        record.count_check = tally.count_check() if tally.saw_output_ids else None
        if record.count_check == "mismatch":
            record.flag("count_mismatch")
        for flag in tally.flags:
            record.flag(flag)
        has_ids = tally.prompt_ids is not None and tally.saw_output_ids
        if has_ids:
            record.ids_source = "upstream"
        else:
            record.ids_source = "none"
            if status == "completed":
                record.flag("missing_token_ids")
        if len(tally.logprobs) != len(tally.output_ids) and tally.output_ids:
            record.flag("logprobs_misaligned")
        if self.assembler.id is not None or status == "completed":
            record.response_json = redacted_json(self.assembler.as_reply(), self.secrets)
        chat_body = self.upstream_body if record.route == "chat" else None
        a = self.assembler
        note_constraints(
            record, chat_body, self.settings.think_markers, bool(a.reasoning), len(a.tool_calls)
        )
        record.trainable = (
            status == "completed" and record.ids_source == "upstream" and not record.fidelity_flags
        )
        fallback = self.settings.retokenizer
        if status == "completed" and not has_ids and record.route != "token_in":
            if fallback is not None and fallback.available and self.upstream_body is not None:
                self.settings.upstream.warn_missing_ids(
                    "retokenizing with polar_tokenizer: those records say ids_source=retokenized "
                    "and are not trainable unless polar_trust_retokenized is set"
                )
                record.fidelity_flags.remove("missing_token_ids")
                job = RetokenizeJob(
                    record,
                    self.upstream_body,
                    self.assembler.message(),
                    self.settings.upstream.template_flavor,
                    prompt_ids=tally.prompt_ids,
                    output_ids=tally.output_ids if tally.saw_output_ids else None,
                )
                return job
            self.settings.upstream.warn_missing_ids(
                "set polar_tokenizer (a Hugging Face tokenizer dir with the chat template) to "
                "retokenize; until then those records have no ids (flag missing_token_ids)"
            )
        return None

    def abort(self, reason: str, status: str = "client_aborted") -> None:
        """Stop the call: the harness went away (mitmproxy's error hook, `client_aborted`) or the
        proxy is shutting down (`incomplete`). The tokens so far stay on the record."""
        self._abort = (status, reason)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        else:
            self.finish(status, reason)


def generate_refused(failure: UpstreamFailed, status: int) -> None:
    """vLLM without --enable-scale-out answers /inference/v1/generate with 403 (an older vLLM:
    404, FastAPI's "Not Found"): the harness is told the fix, not a model name (`read_error`'s
    404 hint). vLLM's own 404 for a model it does not serve keeps its words."""
    if status == 403 or (status == 404 and "does not exist" not in failure.message):
        message = failure.message.split(" (polar-mitm sent model")[0]
        failure.message = f"{message} -- {GENERATE_FIX}"
        failure.args = (failure.message,)


def _without_reasoning(obj: dict[str, Any]) -> dict[str, Any]:
    """A chunk or reply without its reasoning, for a harness that sent include_reasoning: false
    (what vLLM would have done; the record keeps the reasoning, its tokens were sampled)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not any(
        isinstance(c, dict)
        and any(
            isinstance(c.get(k), dict) and ("reasoning" in c[k] or "reasoning_content" in c[k])
            for k in ("delta", "message")
        )
        for c in choices
    ):
        return obj
    out = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = dict(choice)
            for key in ("delta", "message"):
                if isinstance(choice.get(key), dict):
                    part = dict(choice[key])
                    part.pop("reasoning", None)
                    part.pop("reasoning_content", None)
                    choice[key] = part
        out.append(choice)
    return {**obj, "choices": out}


def _int32_array(ids: Sequence[int] | None) -> array | Sequence[int] | None:
    """Prompt ids as `array('i')`: the record's copy (`asdict`), the store's journal and the
    trajectory merge then move them at memcpy speed instead of one Python int at a time. Ids
    that do not fit stay a list, and the store rejects the row with a precise reason."""
    if ids is None:
        return None
    if isinstance(ids, array) and ids.typecode == "i":  # the token-in path's own: never changed
        return ids
    try:
        return array("i", ids)
    except (TypeError, OverflowError):
        return ids


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
