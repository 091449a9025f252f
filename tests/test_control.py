"""The rollout registry and the control API without processes (the e2e tests drive them for real)."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest

from polar_mitm.control import ControlAPI, ControlClient, ControlState, encode, parse_listen
from polar_mitm.core.record import CallRecord
from polar_mitm.trajectory.rollouts import RolloutError, Rollouts

TOKEN = "t0ken-for-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(rollout: str, prompt: list[int], output: list[int], **kw) -> CallRecord:
    from polar_mitm.call.identity import split_group

    group, sample = split_group(rollout)
    r = CallRecord(rollout_id=rollout, group_id=group, sample_index=sample, **kw)
    r.status = kw.get("status", "completed")
    r.ids_source = kw.get("ids_source", "upstream")
    r.trainable = kw.get("trainable", True)
    r.prompt_token_ids = array("i", prompt)
    r.output_token_ids = output
    r.output_logprobs = [-0.5] * len(output)
    return r


def registry(**kw) -> tuple[Rollouts, list[dict], Clock]:
    written: list[dict] = []
    clock = Clock()
    return Rollouts(written.extend, proxy_id="p1", clock=clock, **kw), written, clock


def test_end_writes_rows_and_a_late_reward_writes_a_revision():
    rollouts, written, _ = registry()
    rollouts.call_finished(record("g.0", [1, 2, 3], [4, 99]))
    rollouts.call_finished(record("g.0", [1, 2, 3, 4, 99, 5], [6, 99]))
    r = rollouts.end("g.0", reward=1, status="completed")
    [row] = written
    assert (row["revision"], row["reward"], row["status"], row["proxy_id"]) == (
        0,
        1.0,
        "completed",
        "p1",
    )
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 99, 5, 6, 99] and row["trainable"] is True
    assert r.summary()["state"] == "ended"
    rollouts.end("g.0", reward=0.25, status="error")  # late: same trace id, higher revision
    assert written[1]["trace_id"] == row["trace_id"] and written[1]["revision"] == 1
    assert (written[1]["reward"], written[1]["status"]) == (0.25, "error")
    # a call after the end opens a new rollout under the same id
    rollouts.call_finished(record("g.0", [9], [99]))
    assert [x["state"] for x in rollouts.listing()] == ["ended", "open"]


def test_end_rejects_bad_input():
    rollouts, _, _ = registry()
    rollouts.call_finished(record("a", [1], [2]))
    for kwargs in (
        {"status": "done"},
        {"reward": "high"},
        {"reward": True},
        {"reward": float("nan")},
    ):
        with pytest.raises(RolloutError) as e:
            rollouts.end("a", **kwargs)
        assert e.value.status == 400
    with pytest.raises(RolloutError) as e:
        rollouts.end("nope")
    assert e.value.status == 404


def test_unmerged_calls_and_rollout_level_verdicts():
    rollouts, written, _ = registry()
    rollouts.call_finished(record("r", [1, 2], [3, 99]))
    failed = record("r", [1, 2, 3, 99, 4], [], status="error", error="upstream 500")
    rollouts.call_finished(failed)
    aborted = record("r", [1, 2, 3, 99, 4], [5], status="client_aborted")
    rollouts.call_finished(aborted)
    summary = rollouts.get("r").summary()
    assert summary["calls"] == 3 and summary["unmerged_calls"] == 2 and summary["traces"] == 1
    rollouts.end("r")
    [row] = written
    assert row["trainable"] is False and row["untrainable_reason"].startswith("call_error")
    allowed, written2, _ = registry(allow=frozenset({"call_error"}))
    for rec in (record("r", [1, 2], [3, 99]), failed):
        allowed.call_finished(rec)
    allowed.end("r")
    assert written2[0]["trainable"] is True


def test_idle_end_skips_busy_rollouts_and_counts_from_the_resume():
    rollouts, written, clock = registry()
    rollouts.call_finished(record("a", [1], [2]))
    rollouts.call_finished(record("b", [1], [2]))
    clock.now += 10
    assert rollouts.end_idle(5, busy=lambda rid: rid == "b", not_before=clock.now - 1) == []
    assert rollouts.end_idle(5, busy=lambda rid: rid == "b") == ["a"]
    assert rollouts.get("a").status == "completed" and rollouts.get("b").state == "open"
    assert rollouts.close() == 1 and rollouts.get("b").status == "incomplete"
    assert [w["status"] for w in written] == ["completed", "incomplete"]


def test_groups_and_keep_ended():
    rollouts, _, _ = registry(keep_ended=3)
    for i in (2, 0, 3, 1):
        rollouts.call_finished(record(f"task.{i}", [i], [99]))
    [group] = rollouts.groups()
    assert list(group["samples"]) == ["0", "1", "2", "3"] and group["size"] == 4
    for i in range(4):
        rollouts.end(f"task.{i}", reward=i)
    assert len(rollouts.ended) == 3 and rollouts.get("task.0") is None  # the oldest was dropped


def api_call(api: ControlAPI, method: str, path: str, body: object = None, headers=AUTH):
    raw = json.dumps(body).encode() if body is not None else b""
    return asyncio.run(api.handle(method, path, headers, raw))


def test_api_auth():
    rollouts, _, _ = registry()
    api = ControlAPI(ControlState(), rollouts)
    status, obj = api_call(api, "GET", "/v1/status")
    assert status == 403 and "polar_control_token" in obj["error"]["message"]
    api.token = TOKEN
    assert api_call(api, "GET", "/v1/status", headers={})[0] == 401
    assert api_call(api, "POST", "/v1/pause", headers={"authorization": "Bearer wrong"})[0] == 401
    assert api.state.paused is False
    assert api_call(api, "GET", "/v1/status", headers={"x-polar-control-token": TOKEN})[0] == 200
    assert api_call(api, "GET", "/v1/status")[1]["paused"] is False
    body, headers = encode(401, {})
    assert headers["www-authenticate"].startswith("Bearer")


def test_api_routes_and_errors():
    rollouts, _, _ = registry()
    rollouts.call_finished(record("a/b.1", [1], [99]))  # ids may hold a slash
    api = ControlAPI(ControlState(), rollouts)
    api.token = TOKEN
    assert api_call(api, "GET", "/v2/status")[0] == 404
    assert api_call(api, "DELETE", "/v1/status")[0] == 405
    assert api_call(api, "POST", "/v1/policy", {"version": 3})[0] == 400
    status, obj = api_call(api, "POST", "/v1/policy", {"version": "s1"})
    assert status == 200 and obj == {"policy_version": "s1", "previous": None}
    assert api_call(api, "GET", "/v1/policy")[1] == {"policy_version": "s1"}
    assert asyncio.run(api.handle("POST", "/v1/pause", AUTH, b"{not json"))[0] == 400
    assert api_call(api, "POST", "/v1/pause", {"wait_s": -1})[0] == 400
    assert api_call(api, "GET", "/v1/rollouts/a%2Fb.1")[1]["rollout_id"] == "a/b.1"
    traces = api_call(api, "GET", "/v1/rollouts/a%2Fb.1/traces")[1]
    assert traces["traces"][0]["input_ids"] == [1, 99]
    assert api_call(api, "GET", "/v1/rollouts?group=a/b")[1]["rollouts"][0]["sample_index"] == 1
    status, obj = api_call(api, "POST", "/v1/rollouts/a%2Fb.1/end", {"reward": 0.5})
    assert status == 200 and obj["reward"] == 0.5 and obj["state"] == "ended"
    assert api_call(api, "GET", "/v1/rollouts/missing")[0] == 404


def test_pause_waits_for_in_flight_calls():
    async def scenario() -> None:
        state = ControlState()
        api = ControlAPI(state, registry()[0])
        api.token = TOKEN
        state.call_started("c1", "r")
        _, obj = await api.handle("POST", "/v1/pause", AUTH, b'{"wait_s": 0.01}')
        assert obj["paused"] and obj["in_flight"] == 1 and obj["drained"] is False
        admitted = asyncio.ensure_future(state.admit())
        await asyncio.sleep(0)
        assert state.waiting == 1 and not admitted.done()
        pause = asyncio.ensure_future(api.handle("POST", "/v1/pause", AUTH, b'{"wait_s": 30}'))
        await asyncio.sleep(0)
        rec = CallRecord(rollout_id="r", call_id="c1")
        state.call_finished(rec)  # the in-flight call ends: the pause's wait returns
        assert (await pause)[1]["drained"] is True
        assert rec.policy_version_end is None and not admitted.done()
        _, obj = await api.handle("POST", "/v1/resume", AUTH, b"")
        assert obj["released"] == 1 and await admitted is True
        state.pause()
        later = asyncio.ensure_future(state.admit())
        await asyncio.sleep(0)
        state.shutdown()
        assert await later is False  # shutting down: the waiting call is refused

    asyncio.run(scenario())


def test_parse_listen_and_client_arguments():
    assert parse_listen("8099") == ("127.0.0.1", 8099)
    assert parse_listen("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    with pytest.raises(ValueError):
        parse_listen("host:port")
    with pytest.raises(ValueError):
        ControlClient(TOKEN)
    with pytest.raises(ValueError):
        ControlClient(TOKEN, url="https://x:1")
    unreachable = ControlClient(TOKEN, url="http://127.0.0.1:9", timeout=2)
    with pytest.raises(Exception) as e:
        unreachable.status()
    assert "not reachable" in str(e.value)
