"""One call in process: `Call.run` against the real reference server (SGLang mode), no mitmproxy.

The point is ordering, shown without timing: for a server that returns no ids, the harness's
whole reply is written before the record's slow work (retokenizing) even starts to matter — the
retokenizer here waits on an event the test sets only after checking the harness has everything.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
from polar_reference import PolicyServer, ServerConfig
from polar_reference.scenario import load_scenario

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.call.exchange import Call, UpstreamSettings
from polar_mitm.core.record import CallRecord
from polar_mitm.dialects.openai_chat import OpenAIChat
from polar_mitm.tokens.retokenize import RetokenizeJob, Retokenizer, RetokenizeResult
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.upstream.sglang import SGLang
from tests.helpers import TESTS

SCENARIO = TESTS / "scenarios" / "three_turns.json"  # the end-to-end capture tests' script


class RecordingOutput:
    """`exchange.Output` that keeps what the harness would get."""

    def __init__(self) -> None:
        self.started = False
        self.status: int | None = None
        self.body = b""

    async def start(self, status: int, content_type: str) -> None:
        self.started, self.status = True, status

    async def write(self, data: bytes) -> None:
        self.body += data

    async def end(self, data: bytes) -> None:
        self.body += data

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.started, self.status, self.body = True, status, body


class GatedRetokenizer(Retokenizer):
    """Retokenizes only once the test opens the gate (from the worker thread it runs in)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def compute(self, job: RetokenizeJob) -> RetokenizeResult:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().compute(job)


class ListSink:
    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    def call_finished(self, record: CallRecord) -> None:
        self.records.append(record)


def test_reply_is_complete_before_the_record_is_retokenized():
    async def scenario() -> None:
        server = PolicyServer(
            ServerConfig(scenario=load_scenario(SCENARIO), kind="sglang", ignore_token_flags=True)
        )
        url = await server.start()
        retokenizer = GatedRetokenizer(load_tokenizer(str(qwen3_tokenizer_dir())))
        sink = ListSink()
        dialect = OpenAIChat()
        body = {"model": "gpt", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        req = dialect.parse(json.dumps(body).encode(), "/v1/chat/completions")
        upstream = SGLang(url)
        settings = UpstreamSettings(upstream, "Qwen/Qwen3-4B", retokenizer=retokenizer)
        call = Call(CallRecord(rollout_id="r.0"), dialect, req, settings=settings, sinks=[sink])
        out = RecordingOutput()
        try:
            async with aiohttp.ClientSession() as session:
                await call.run(out, session)  # returns when the harness's reply is complete
            events = [line for line in out.body.decode().split("\n\n") if line]
            assert out.status == 200 and events[-1] == "data: [DONE]"
            text = "".join(
                json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                for e in events[:-1]
                if json.loads(e[6:]).get("choices")
            )
            assert "tool_call" in text  # no tools sent: the scripted call stays text
            assert sink.records == []  # the record waits for the retokenizer, the harness did not
            await asyncio.to_thread(retokenizer.entered.wait, 30)
            retokenizer.gate.set()
            await retokenizer.drain()
        finally:
            retokenizer.gate.set()
            await server.stop()
        [record] = sink.records
        assert record.status == "completed" and record.ids_source == "retokenized"
        assert record.count_check == "ok" and record.fidelity_flags == ["retokenized"]
        assert record.first_byte_at is not None and record.first_byte_at <= record.finished_at

    asyncio.run(scenario())
