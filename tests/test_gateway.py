"""The gateway's HTTP/1 protocol, driven over a real loopback socket as mitmproxy drives it: one
bodiless POST per call, connections kept alive, the harness leaving mid-reply."""

from __future__ import annotations

import asyncio
from typing import Any

from polar_mitm.call.exchange import ClientGone
from polar_mitm.call.gateway import PATH_PREFIX, Gateway


class FakeCall:
    """Stands in for `exchange.Call`: runs a script of Output operations."""

    def __init__(self, call_id: str, steps: list[tuple[str, Any]]) -> None:
        self.record = type("Record", (), {"call_id": call_id})()
        self.steps = steps
        self.gone = False
        self.done = asyncio.Event()

    async def run(self, out, session) -> None:
        try:
            for op, arg in self.steps:
                if op == "start":
                    await out.start(200, "text/event-stream")
                elif op == "write":
                    await out.write(arg)
                elif op == "end":
                    await out.end(arg)
                elif op == "send":
                    await out.send(*arg)
                elif op == "wait":
                    await arg.wait()
        except ClientGone:
            self.gone = True
        finally:
            self.done.set()


async def _request(reader, writer, call_id: str, extra: bytes = b"") -> tuple[bytes, bytes]:
    writer.write(
        f"POST {PATH_PREFIX}{call_id} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode()
        + extra
        + b"content-length: 0\r\n\r\n"
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            body += await reader.readexactly(size + 2)
            if size == 0:
                return head, body
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(length)


def _run(test) -> None:
    async def main() -> None:
        gateway = Gateway()
        await gateway.start(5.0, 5.0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
            await asyncio.wait_for(test(gateway, reader, writer), 20)
            writer.close()
        finally:
            await gateway.stop()

    asyncio.run(main())


def test_streams_chunks_and_serves_the_next_call_on_the_same_connection() -> None:
    async def test(gateway, reader, writer) -> None:
        for n in range(3):
            steps = [("start", None), ("write", b"data: a\n\n"), ("end", b"data: [DONE]\n\n")]
            gateway.register(FakeCall(f"c{n}", steps))
            head, body = await _request(reader, writer, f"c{n}")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"text/event-stream" in head
            assert body == b"data: a\n\n\r\ndata: [DONE]\n\n\r\n\r\n"
        assert not gateway.calls

    _run(test)


def test_whole_responses_errors_and_unknown_calls() -> None:
    async def test(gateway, reader, writer) -> None:
        steps = [("send", (429, b'{"error":1}', "application/json", {"retry-after": "3"}))]
        gateway.register(FakeCall("e", steps))
        head, body = await _request(reader, writer, "e")
        assert head.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
        assert b"retry-after: 3\r\n" in head and body == b'{"error":1}'
        head, body = await _request(reader, writer, "nobody")
        assert head.startswith(b"HTTP/1.1 404 ") and b"unknown call" in body
        # a failure mid-stream ends with the dialect's error event: the gateway ends the body
        gateway.register(FakeCall("f", [("start", None), ("write", b"data: {error}\n\n")]))
        head, body = await _request(reader, writer, "f")
        assert body == b"data: {error}\n\n\r\n\r\n"

    _run(test)


def test_a_request_with_a_body_is_refused_and_the_connection_closed() -> None:
    async def test(gateway, reader, writer) -> None:
        writer.write(f"POST {PATH_PREFIX}x HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ")
        await reader.read()  # then EOF

    _run(test)


def test_the_harness_leaving_mid_reply_reaches_the_call_as_client_gone() -> None:
    async def test(gateway, reader, writer) -> None:
        release = asyncio.Event()
        call = FakeCall(
            "g", [("start", None), ("wait", release), ("write", b"data: late\n\n"), ("end", b"")]
        )
        gateway.register(call)
        writer.write(f"POST {PATH_PREFIX}g HTTP/1.1\r\ncontent-length: 0\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
        writer.close()  # mitmproxy drops the connection: the harness left
        await asyncio.sleep(0.2)
        release.set()
        await call.done.wait()
        assert call.gone

    _run(test)


def test_a_slow_reader_holds_the_writer_back() -> None:
    """Backpressure: a reader that does not read pauses the call's writes instead of letting
    the gateway buffer the whole reply."""

    async def test(gateway, reader, writer) -> None:
        piece, chunks = b"x" * 65536, 2000  # 128 MB: far more than any socket buffer
        steps = [("start", None), *[("write", piece)] * chunks, ("end", b"")]
        call = FakeCall("s", steps)
        gateway.register(call)
        writer.write(f"POST {PATH_PREFIX}s HTTP/1.1\r\ncontent-length: 0\r\n\r\n".encode())
        await asyncio.sleep(0.5)  # not reading: the call must be waiting, not finished
        assert not call.done.is_set()
        [conn] = gateway.connections
        assert conn.transport.get_write_buffer_size() < 64 * len(piece)
        await reader.readuntil(b"\r\n\r\n")
        total = 0
        while True:
            size = int((await reader.readline()).strip(), 16)
            await reader.readexactly(size + 2)
            total += size
            if size == 0:
                break
        assert total == chunks * len(piece) and call.done.is_set() and not call.gone

    _run(test)


def test_route_points_a_flow_at_the_gateway_with_no_body() -> None:
    """`route` registers the call and rewrites the flow the way the gateway serves it: its path
    names the call, and the harness's body stays behind (the gateway refuses one)."""
    from mitmproxy.test import tflow

    async def test(gateway, reader, writer) -> None:
        flow = tflow.tflow()
        flow.request.url = "https://api.openai.com/v1/chat/completions"
        flow.request.content = b'{"messages": []}'
        gateway.route(flow, FakeCall("r1", [("start", None), ("end", b"data: [DONE]\n\n")]))
        assert gateway.calls["r1"].record.call_id == "r1"
        assert flow.request.url == f"http://127.0.0.1:{gateway.port}{PATH_PREFIX}r1"
        assert flow.request.method == "POST" and flow.request.content == b""
        assert dict(flow.request.headers) == {
            "host": f"127.0.0.1:{gateway.port}",
            "content-length": "0",
        }
        head, body = await _request(reader, writer, "r1")  # what mitmproxy then sends
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body.startswith(b"data: [DONE]\n\n")

    _run(test)
