"""What the real harnesses sent (tests/fixtures/harness/, recorded by tests/e2e/record_wire.py),
replayed byte for byte through real mitmdump with the addon: every LLM request is served in the
harness's dialect and captured, every other request on a captured host is answered locally and
never reaches the policy server, and Codex's WebSocket attempt gets a 426.

No npm needed: these run wherever the rest of the suite runs, and pin down the parts of the wire
that the tests/e2e/ runs of the binaries depend on.
"""

from __future__ import annotations

import json

import httpx
import pytest

from polar_mitm.addons.capture import DEFAULT_HOSTS
from polar_mitm.core.sse import SSEParser
from polar_mitm.store import read_table
from tests.helpers import TESTS
from tests.helpers.clients import grep_bytes, http_client

FIXTURES = TESTS / "fixtures" / "harness"
SCENARIO = TESTS / "e2e" / "scenarios" / "harnesses.json"
HARNESSES = ("pi", "codex", "claude", "qwen", "opencode")
# LLM requests of one recorded run: the two turns, and OpenCode's title call before them.
LLM_REQUESTS = {"opencode": 3}
LLM_ENDPOINTS = {"/v1/chat/completions", "/v1/responses", "/v1/messages"}
POLAR_HOSTS = set(DEFAULT_HOSTS.split(","))
# Not replayed: hop-by-hop and framing headers (httpx sets its own), the redacted credentials
# (replaced by a polar- key), and HTTP/2 pseudo-headers.
_DROP = {
    "host",
    "connection",
    "content-length",
    "accept-encoding",
    "transfer-encoding",
    "proxy-connection",
    "keep-alive",
    "authorization",
    "x-api-key",
}
# The event that ends a successful stream, per dialect.
_LAST_EVENT = {
    "/v1/chat/completions": "[DONE]",
    "/v1/responses": "response.completed",
    "/v1/messages": "message_stop",
}


def recorded(name: str) -> list[dict]:
    entries = [json.loads(p.read_text()) for p in sorted((FIXTURES / name).glob("*.json"))]
    assert entries, f"no fixtures under {FIXTURES / name}: run python -m tests.e2e.record_wire"
    return sorted(entries, key=lambda e: e["seq"])


def is_llm(entry: dict) -> bool:
    return entry["method"] == "POST" and entry["path"].partition("?")[0] in LLM_ENDPOINTS


def replay_headers(entry: dict, key: str) -> dict[str, str]:
    headers = {
        k: v for k, v in entry["headers"] if k.lower() not in _DROP and not k.startswith(":")
    }
    if any(k.lower() == "x-api-key" for k, _ in entry["headers"]):
        headers["x-api-key"] = key
    elif any(k.lower() == "authorization" for k, _ in entry["headers"]):
        headers["authorization"] = f"Bearer {key}"
    return headers


def send(client: httpx.Client, entry: dict, key: str) -> httpx.Response:
    body = entry.get("body")
    content = json.dumps(body).encode() if body is not None else None
    url = f"https://{entry['host']}{entry['path']}"
    return client.request(entry["method"], url, content=content, headers=replay_headers(entry, key))


def last_event(raw: bytes) -> str:
    events = SSEParser().feed(raw)
    assert events, raw[:500]
    last = events[-1]
    if last.data == "[DONE]":
        return "[DONE]"
    return last.event or json.loads(last.data).get("type", "")


def test_fixtures_hold_no_secret_or_local_path():
    for path in FIXTURES.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        assert "polar-record" not in text, path  # the replaced keys
        assert "/tmp/wire-" not in text, path  # temp dirs are normalized
        if path.suffix == ".json":
            for name, value in json.loads(text)["headers"]:
                secret = ("authorization", "x-api-key", "proxy-authorization", "cookie")
                if name.lower() in (*secret, "x-goog-api-key"):
                    assert value.startswith("[redacted"), (path, name)


@pytest.mark.parametrize("name", HARNESSES)
def test_recorded_llm_requests_are_served_and_captured(name, make_policy_server, make_mitm):
    """Each recorded LLM request body (turn 1, and turn 2 with the tool result), replayed with
    the harness's own headers, gets a complete stream in its dialect and one completed row."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    key = f"polar-replay-{name}.0"
    llm = [e for e in recorded(name) if is_llm(e)]
    assert len(llm) == LLM_REQUESTS.get(name, 2)
    with http_client(mitm) as client:
        for entry in llm:
            r = send(client, entry, key)
            assert r.status_code == 200, r.text[:2000]
            assert r.headers["content-type"].startswith("text/event-stream")
            assert last_event(r.content) == _LAST_EVENT[entry["path"].partition("?")[0]]
    assert mitm.stop() == 0
    rows = sorted(read_table(str(mitm.output), "calls").to_pylist(), key=lambda r: r["started_at"])
    assert [r["status"] for r in rows] == ["completed"] * len(llm), [r["error"] for r in rows]
    for row, entry in zip(rows, llm, strict=True):
        assert row["path"] == entry["path"].partition("?")[0]
        assert row["model_requested"] == entry["body"]["model"]
        assert row["prompt_token_ids"] and row["output_token_ids"]
        assert row["ids_source"] == "upstream" and row["trainable"] is True
    if name == "codex":  # no API key on Codex's wire: identity from its session header
        assert rows[0]["rollout_source"] == "session"
        assert rows[0]["session_id"] == dict(llm[0]["headers"])["session-id"]
    else:
        assert {r["rollout_id"] for r in rows} == {f"replay-{name}.0"}
    if name == "opencode":  # its title call (no tools) is a side call; its session names it
        assert [r["purpose"] for r in rows] == ["title", "main", "main"]
        assert {r["agent"] for r in rows} == {dict(llm[0]["headers"])["x-session-id"]}
    # Turn 2 ends with the tool result the harness sent; the prompt holds it.
    assert len(rows[-1]["prompt_token_ids"]) > len(rows[-2]["prompt_token_ids"])
    assert grep_bytes(mitm.output, [key]) == {}


@pytest.mark.parametrize("name", ["codex", "claude"])
def test_recorded_side_requests_are_answered_locally(name, make_policy_server, make_mitm):
    """Settings, feature flags, plugins, telemetry on the captured hosts: a JSON 404 from the
    proxy (what the harnesses carried on after), nothing upstream, no call rows; the WebSocket
    upgrade on Codex's LLM path: 426."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    side = [e for e in recorded(name) if e["host"] in POLAR_HOSTS and not is_llm(e)]
    assert side
    with http_client(mitm) as client:
        for entry in side:
            r = send(client, entry, f"polar-replay-{name}.0")
            websocket = any(
                k.lower() == "upgrade" and v == "websocket" for k, v in entry["headers"]
            )
            assert r.status_code == (426 if websocket else 404), (entry["path"], r.text)
            error = r.json()["error"]
            assert "polar-mitm" in error["message"] and error["type"]
    upstream = httpx.get(server.url + "/_polar/requests", timeout=10).json()
    assert [u for u in upstream if u["path"] != "/v1/models"] == []
    assert mitm.stop() == 0
    assert read_table(str(mitm.output), "calls").num_rows == 0
