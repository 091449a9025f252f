"""Durability through the real proxy: SIGKILL mid-stream, restart, recovery; a corrupted journal.

The guarantee tested (docs/store.md, "Durability"): with ``polar_durable_replies`` on (the
default) a harness receives the last event of a reply (``data: [DONE]``) only after the call's
record is fsynced in the journal. So every reply a client saw complete is in ``calls/`` after a
kill -9 and a restart, exactly once; a call cut off by the kill is absent, or — when the kill fell
between the fsync and the last bytes — present as the complete generation it was.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections import Counter
from pathlib import Path

import httpx
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from polar_mitm.store import list_shards, read_table
from tests.helpers.clients import http_client
from tests.helpers.procs import Mitm, start_policy_server

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
KILL_SCENARIO = {
    "model": "Qwen/Qwen3-4B",
    "scripts": [{"name": "reply", "turns": [{"content": " ".join(WORDS)}]}],
}
IN_FLIGHT = 32
ITERATIONS = 20


@pytest.fixture(scope="module")
def paced_server(tmp_path_factory: pytest.TempPathFactory):
    """One policy server for every iteration, paced so that calls are mid-stream at the kill."""
    tmp = tmp_path_factory.mktemp("paced")
    scenario = tmp / "kill.json"
    scenario.write_text(json.dumps(KILL_SCENARIO))
    server = start_policy_server(tmp, scenario, ["--token-rate", "50"])
    yield server
    server.stop()


def raw_calls(output: Path) -> list[dict]:
    """Every row of every shard, no deduplication: what DuckDB or a plain pyarrow reader sees."""
    paths = list_shards(output, "calls")
    if not paths:
        return []
    cols = ["rollout_id", "status", "finish_reason", "output_token_ids", "usage_completion_tokens"]
    return ds.dataset(paths, format="parquet").to_table(columns=cols).to_pylist()


async def _load(mitm: Mitm, iteration: int, kill_after: int) -> dict:
    """IN_FLIGHT workers calling in a loop; SIGKILL the proxy right after the ``kill_after``-th
    completed reply. Returns what the clients saw."""
    done: set[str] = set()
    started: set[str] = set()
    mid_stream: set[str] = set()  # got content, never [DONE]
    killed = asyncio.Event()
    at_kill: dict[str, int] = {}
    in_flight: set[str] = set()  # request sent, reply not ended
    streaming: set[str] = set()  # content received, reply not ended

    async def worker(w: int) -> None:
        async with httpx.AsyncClient(proxy=mitm.url, verify=str(mitm.ca), timeout=30) as client:
            n = 0
            while not killed.is_set():
                rid = f"k{iteration}-w{w}-n{n}"
                n += 1
                body = {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": rid}],
                }
                started.add(rid)
                in_flight.add(rid)
                content = False
                try:
                    async with client.stream(
                        "POST",
                        "https://api.openai.com/v1/chat/completions",
                        json=body,
                        headers={"authorization": f"Bearer polar-{rid}"},
                    ) as r:
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                done.add(rid)
                                in_flight.discard(rid)
                                streaming.discard(rid)
                                if (
                                    len(done) >= kill_after
                                    and len(in_flight) >= IN_FLIGHT - 2
                                    and not killed.is_set()
                                ):
                                    at_kill["in_flight"] = len(in_flight)
                                    at_kill["streaming"] = len(streaming)
                                    os.kill(mitm.proc.popen.pid, signal.SIGKILL)
                                    killed.set()
                            elif line.startswith("data: {"):
                                content = True
                                streaming.add(rid)
                except httpx.HTTPError:
                    if not killed.is_set():
                        raise
                in_flight.discard(rid)
                streaming.discard(rid)
                if content and rid not in done:
                    mid_stream.add(rid)

    await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(IN_FLIGHT))), 60)
    return {"done": done, "started": started, "mid_stream": mid_stream, **at_kill}


def test_sigkill_mid_stream_then_restart_loses_no_completed_reply(
    tmp_path: Path, make_mitm, paced_server
) -> None:
    output = tmp_path / "data"
    rng = random.Random(7)
    options = {"polar_output": output, "polar_flush_rows": 5, "polar_flush_seconds": 0.3}
    done: set[str] = set()
    started: set[str] = set()
    mid_stream = 0
    stats: list[tuple[int, int]] = []  # (in flight, mid-stream) at each kill
    for it in range(ITERATIONS):
        mitm = make_mitm(paced_server.url, **options)
        report = mitm.proc.wait_for(r"polar-mitm: writing to \S+ \((.*)\)").group(1)
        if it:  # what the previous kill left is recovered before anything new is captured
            assert "journal" in report, report
            have = Counter(r["rollout_id"] for r in raw_calls(output))
            wrong = {rid: have[rid] for rid in done if have[rid] != 1}
            assert not wrong, (wrong, report)
        seen = asyncio.run(_load(mitm, it, kill_after=rng.randint(4, 40)))
        assert mitm.proc.popen.wait(10) == -signal.SIGKILL
        mitm.proc.stop()
        assert seen["in_flight"] >= IN_FLIGHT - 2  # the kill found the calls in flight
        stats.append((seen["in_flight"], seen["streaming"]))
        done |= seen["done"]
        started |= seen["started"]
        mid_stream += len(seen["mid_stream"])
    print("calls in flight / mid-stream at each kill:", stats)
    assert mid_stream >= ITERATIONS, f"the kills seldom cut a reply mid-stream: {stats}"

    last = make_mitm(paced_server.url, **options)
    last.proc.wait_for(r"polar-mitm: writing to")
    assert last.stop() == 0, last.proc.output()

    rows = raw_calls(output)
    count = Counter(r["rollout_id"] for r in rows)
    assert [rid for rid, n in count.items() if n > 1] == []  # nothing written twice
    assert set(count) <= started
    missing = done - set(count)
    assert not missing, f"{len(missing)} replies the client saw complete were lost: {missing}"
    for row in rows:
        # Only whole generations reach calls/: a kill before the fsync leaves nothing, after it
        # (and before the client's [DONE]) the complete record.
        assert row["status"] == "completed" and row["finish_reason"] == "stop", row
        assert row["usage_completion_tokens"] == len(row["output_token_ids"]) > len(WORDS)
    for path in list_shards(output, "calls"):
        pq.read_table(path)  # every shard opens
    assert not list(output.rglob("*.tmp")), "temp shards left behind"
    assert read_table(output, "calls").num_rows == len(count)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "truncated+garbage"])
def test_corrupt_journal_tail_is_recovered_at_proxy_start(
    tmp_path: Path, make_mitm, paced_server, damage: str
) -> None:
    output = tmp_path / "data"
    options = {"polar_output": output, "polar_flush_rows": 10_000, "polar_flush_seconds": 3600}
    mitm = make_mitm(paced_server.url, **options)
    mitm.proc.wait_for("polar-mitm: writing to")
    with http_client(mitm) as client:
        for i in range(5):
            r = client.post(
                "https://api.openai.com/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer polar-corrupt.{i}"},
            )
            assert r.status_code == 200, r.text
    os.kill(mitm.proc.popen.pid, signal.SIGKILL)
    mitm.proc.stop()
    [segment] = sorted((output / "_journal").glob("seg-*.log"))
    data = segment.read_bytes()
    if "truncated" in damage:
        data = data[:-10]  # a crash mid-write of the last record
    if "garbage" in damage:
        data += random.Random(3).randbytes(200)
    segment.write_bytes(data)

    again = make_mitm(paced_server.url, **options)
    report = again.proc.wait_for(r"polar-mitm: writing to \S+ \((.*)\)").group(1)
    log = again.proc.output()
    assert "damaged tail(s) skipped" in report and str(segment) in log, log
    assert "Traceback" not in log
    with http_client(again) as client:  # the proxy works after recovering
        r = client.post(
            "https://api.openai.com/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer polar-corrupt.after"},
        )
        assert r.status_code == 200, r.text
    assert again.stop() == 0
    expected = [f"corrupt.{i}" for i in range(4 if "truncated" in damage else 5)] + [
        "corrupt.after"
    ]
    assert sorted(read_table(output, "calls").column("rollout_id").to_pylist()) == expected
    assert not list((output / "_journal").glob("seg-*.log"))
