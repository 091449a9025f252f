"""Google's Gemini API end to end: plain HTTPS requests (the bodies the `@google/genai` SDK and
Gemini CLI send) through HTTPS_PROXY and real mitmdump + addon to the reference policy server,
against every server kind; Gemini CLI 0.61.0's recorded requests replayed; the API key, in the
`x-goog-api-key` header or the `?key=` query, identifies the rollout and never reaches disk."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.dialects.convert import unseal
from polar_mitm.store import read_table
from tests.e2e.loopback.test_capture_e2e import calls_of
from tests.e2e.loopback.test_dialects_e2e import (
    FINAL_TEXT,
    QUESTION,
    SCENARIO,
    SYSTEM,
    assistant,
    check_prefix_merges,
    check_reasoning_rendered,
    check_rows,
    same_when_merged,
)
from tests.helpers import TESTS
from tests.helpers.broken_upstream import BrokenUpstream
from tests.helpers.clients import RUN_SHELL, TOOL_OUTPUTS, grep_bytes, http_client

BASE = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro"
HARNESS_SCENARIO = TESTS / "e2e" / "scenarios" / "harnesses.json"
FIXTURES = TESTS / "fixtures" / "harness" / "gemini"
DECLARATION = {
    "name": "run_shell",
    "description": RUN_SHELL["function"]["description"],
    "parametersJsonSchema": RUN_SHELL["function"]["parameters"],
}


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def sse(r: httpx.Response) -> list[dict]:
    """The events of a Google SSE reply (`data: {...}` then a blank line, \\r\\n or \\n)."""
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def generate(client: httpx.Client, body: dict, stream: bool, key: str) -> list[dict]:
    """One call; the responses the client got (one, or one per event)."""
    url = BASE + (":streamGenerateContent?alt=sse" if stream else ":generateContent")
    with client.stream("POST", url, json=body, headers={"x-goog-api-key": key}) as r:
        r.read()
        assert r.status_code == 200, r.text
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream")
            return sse(r)
        return [r.json()]


def parts_of(responses: list[dict]) -> list[dict]:
    return [p for r in responses for p in r["candidates"][0]["content"]["parts"]]


def turn_of(responses: list[dict]) -> tuple[str, str, list[dict]]:
    """A model turn's thoughts, visible text and function calls."""
    parts = parts_of(responses)
    thought = "".join(p["text"] for p in parts if p.get("thought"))
    text = "".join(p["text"] for p in parts if "text" in p and not p.get("thought"))
    return thought, text, [p["functionCall"] for p in parts if "functionCall" in p]


def tool_loop(mitm, stream: bool, key: str) -> list[list[dict]]:
    """The scripted tool loop as Gemini CLI runs it: each model turn sent back without its
    thought parts (their signature carries the thinking), each functionResponse with the call's
    id. The responses of each turn."""
    contents: list[dict] = [{"role": "user", "parts": [{"text": QUESTION}]}]
    replies: list[list[dict]] = []
    with http_client(mitm) as client:
        for _ in range(3):
            body = {
                "contents": contents,
                "systemInstruction": {"parts": [{"text": SYSTEM}]},
                "tools": [{"functionDeclarations": [DECLARATION]}],
                "generationConfig": {"thinkingConfig": {"includeThoughts": True}},
            }
            responses = generate(client, body, stream, key)
            replies.append(responses)
            assert {r["modelVersion"] for r in responses} == {"gemini-2.5-pro"}
            assert responses[-1]["candidates"][0]["finishReason"] == "STOP"
            parts = parts_of(responses)
            contents = [
                *contents,
                {"role": "model", "parts": [p for p in parts if not p.get("thought")]},
            ]
            calls = [p["functionCall"] for p in parts if "functionCall" in p]
            if not calls:
                break
            contents.append(
                {
                    "role": "user",
                    "parts": [
                        {
                            "functionResponse": {
                                "id": c["id"],
                                "name": c["name"],
                                "response": {"output": TOOL_OUTPUTS[c["args"]["cmd"]]},
                            }
                        }
                        for c in calls
                    ],
                }
            )
    return replies


def test_a_whole_reply_in_one_chunk(make_policy_server, make_mitm, upstream_kind):
    """same_when_merged (test_dialects_e2e.py), for Gemini CLI's loop: the same thoughts, texts
    and calls (their ids are new on every call)."""

    def run(mitm, key: str) -> list[tuple[str, str, list[dict]]]:
        turns = [turn_of(responses) for responses in tool_loop(mitm, True, key)]
        for _, _, calls in turns:
            for call in calls:
                call.pop("id")
        return turns

    same_when_merged(make_policy_server, make_mitm, upstream_kind, run)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_three_turn_tool_conversation(make_policy_server, make_mitm, qwen3, stream, upstream_kind):
    """The scripted tool loop (tool_loop). Every call's ids are exactly the server's for the chat
    the test writes out, and each prompt extends the last one: one main chain."""
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    replies = tool_loop(mitm, stream, "polar-gem.2")
    turns = []
    for responses in replies:
        thought, text, calls = turn_of(responses)
        [signature] = [
            p["thoughtSignature"] for p in parts_of(responses) if "thoughtSignature" in p
        ]
        assert unseal(signature) == thought  # the thinking, sealed on the first part after it
        turns.append((thought, text, calls))
    assert [[c["args"] for c in calls] for _, _, calls in turns] == [
        [{"cmd": "cat notes.txt"}],
        [{"cmd": "wc -l notes.txt"}],
        [],
    ]
    assert turns[0][0].strip() == "I should look at the file first."
    assert turns[2][1].strip() == FINAL_TEXT

    def chat_turn(i: int) -> dict:
        thought, text, calls = turns[i]
        args = [(c["id"], c["name"], json.dumps(c["args"], separators=(",", ":"))) for c in calls]
        return assistant(thought, text, args)

    def tool_result(i: int) -> dict:
        [call] = turns[i][2]
        output = TOOL_OUTPUTS[call["args"]["cmd"]]
        return {"role": "tool", "tool_call_id": call["id"], "content": output}

    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    after1 = [*base, chat_turn(0), tool_result(0)]
    after2 = [*after1, chat_turn(1), tool_result(1)]
    rows = calls_of(mitm)
    check_rows(
        rows,
        [base, after1, after2],
        server,
        upstream_kind,
        qwen3,
        "gem.2",
        "google_gemini",
        [RUN_SHELL],
    )
    check_reasoning_rendered(qwen3, rows[1], turns[0][0])
    check_prefix_merges(rows)
    for responses, row in zip(replies, rows, strict=True):
        usage = responses[-1]["usageMetadata"]
        assert usage["promptTokenCount"] == row["usage_prompt_tokens"]
        assert usage["promptTokenCount"] == len(row["prompt_token_ids"])
        completion = usage["candidatesTokenCount"] + usage.get("thoughtsTokenCount", 0)
        assert completion == row["usage_completion_tokens"] == len(row["output_token_ids"])
        assert usage["totalTokenCount"] == usage["promptTokenCount"] + completion
    traces = read_table(str(mitm.output), "traces").to_pylist()
    assert [(t["role"], t["call_ids"]) for t in traces] == [("main", [r["call_id"] for r in rows])]
    assert grep_bytes(mitm.output, ["polar-gem.2"]) == {}


def test_count_tokens_and_the_query_key(make_policy_server, make_mitm, qwen3):
    """countTokens is answered locally with the policy tokenizer, equal to the prompt the server
    then computes; a `?key=polar-...` names the rollout and is in no record, shard, journal or
    log line, and a refused request's flow line drops it too."""
    key = "polar-gq.5"
    server = make_policy_server(SCENARIO)
    # flow_detail 2: mitmdump prints each flow's whole URL and its headers
    mitm = make_mitm(server.url, polar_tokenizer=str(qwen3_tokenizer_dir()), flow_detail=2)
    body = {
        "contents": [{"role": "user", "parts": [{"text": QUESTION}]}],
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "tools": [{"functionDeclarations": [DECLARATION]}],
    }
    with http_client(mitm) as c:
        r = c.post(BASE + f":countTokens?key={key}", json=body)
        assert r.status_code == 200, r.text
        counted = r.json()["totalTokens"]
        r = c.post(BASE + f":generateContent?key={key}", json=body)
        assert r.status_code == 200, r.text
        r = c.post(BASE + f":generateContent?key={key}", content=b"{not json")
        assert r.status_code == 400
        assert r.json()["error"]["status"] == "INVALID_ARGUMENT"
    local, row, refused = calls_of(mitm)
    assert (local["route"], local["purpose"], local["status"]) == (
        "local",
        "count_tokens",
        "completed",
    )
    assert counted == len(row["prompt_token_ids"])  # the tokenizer's count is the server's prompt
    assert (row["model_requested"], row["model_served"]) == ("gemini-2.5-pro", "Qwen/Qwen3-4B")
    for r in (local, row, refused):
        assert (r["rollout_id"], r["rollout_source"]) == ("gq.5", "api_key")
        assert "?" not in r["path"] and r["dialect"] == "google_gemini"
    assert (refused["status"], refused["http_status"]) == ("error", 400)
    assert grep_bytes(mitm.output, [key]) == {}
    log = mitm.proc.output()
    assert "gemini-2.5-pro:countTokens" in log and key not in log, log


def test_bad_requests_get_googles_error(make_policy_server, make_mitm):
    """Each refusal: the HTTP status with `{"error": {code, message, status}}`, and a record
    marked error that keeps what was sent."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    cases = [
        (BASE + ":generateContent", b"[1, 2]", "must be a JSON object"),
        (
            BASE + ":generateContent",
            json.dumps({"contents": []}).encode(),
            "'contents' is required",
        ),
        (
            BASE + ":generateContent",
            json.dumps(
                {"contents": [{"parts": [{"text": "x"}]}], "tools": [{"googleSearch": {}}]}
            ).encode(),
            "Google tool 'googleSearch'",
        ),
        (BASE + ":streamGenerateContent", json.dumps({"contents": []}).encode(), "add ?alt=sse"),
    ]
    with http_client(mitm) as c:
        for url, raw, needle in cases:
            r = c.post(url, content=raw, headers={"x-goog-api-key": "polar-bad.0"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
            assert needle in error["message"]
    rows = calls_of(mitm)
    assert [(r["dialect"], r["status"], r["http_status"]) for r in rows] == [
        ("google_gemini", "error", 400)
    ] * len(cases)
    for row, (_, raw, needle) in zip(rows, cases, strict=True):
        assert needle in row["error"] and row["rollout_id"] == "bad.0"
        assert json.loads(row["request_json"]) == {"unparsed_body": raw.decode()}
    upstream = httpx.get(server.url + "/_polar/requests", timeout=10).json()
    assert [u for u in upstream if u["path"] != "/v1/models"] == []


def test_upstream_failure_mid_stream_ends_with_googles_error(make_mitm):
    broken = BrokenUpstream()
    try:
        mitm = make_mitm(broken.url, polar_model="Qwen/Qwen3-4B")
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        with (
            http_client(mitm) as c,
            c.stream("POST", BASE + ":streamGenerateContent?alt=sse", json=body, headers={}) as r,
        ):
            assert r.status_code == 200
            events = sse(r)
        rows = calls_of(mitm)
    finally:
        broken.stop()
    text = "".join(
        p.get("text", "") for e in events[:-1] for p in e["candidates"][0]["content"]["parts"]
    )
    assert text == "half a reply"
    error = events[-1]["error"]
    assert (error["code"], error["status"]) == (500, "INTERNAL")
    assert "ended the stream" in error["message"]
    assert [(r["dialect"], r["status"]) for r in rows] == [("google_gemini", "error")]


def test_gemini_cli_recorded_requests_are_served(make_policy_server, make_mitm):
    """Gemini CLI 0.61.0's own requests, replayed with its headers: its router call (JSON
    output, no tools) is answered whole and is a side call; the agent loop's two calls stream;
    its telemetry (play.googleapis.com) is answered locally."""
    entries = sorted(
        (json.loads(p.read_text()) for p in FIXTURES.glob("*.json")), key=lambda e: e["seq"]
    )
    server = make_policy_server(HARNESS_SCENARIO)
    mitm = make_mitm(server.url)
    key = "polar-replay-gemini.0"
    skip = {"host", "connection", "content-length", "accept-encoding", "x-goog-api-key"}
    with http_client(mitm) as c:
        for e in entries:
            headers = {k: v for k, v in e["headers"] if k.lower() not in skip}
            headers["x-goog-api-key"] = key
            url = f"https://{e['host']}{e['path']}"
            r = c.post(url, content=json.dumps(e["body"]).encode(), headers=headers)
            if e["host"] == "play.googleapis.com":
                assert r.status_code == 404 and "polar-mitm" in r.json()["error"]["message"]
                continue
            assert r.status_code == 200, r.text[:2000]
            if ":streamGenerateContent" in e["path"]:
                events = [json.loads(x[6:]) for x in r.text.split("\r\n\r\n") if x]
                assert events[-1]["candidates"][0]["finishReason"] == "STOP"
            else:
                parts = r.json()["candidates"][0]["content"]["parts"]
                reply = json.loads("".join(p["text"] for p in parts if not p.get("thought")))
                assert reply["complexity_score"] == 10  # what the scenario's router answers
    rows = calls_of(mitm)
    assert [(r["purpose"], r["status"], r["stream"]) for r in rows] == [
        ("side", "completed", False),
        ("main", "completed", True),
        ("main", "completed", True),
    ]
    assert {r["rollout_id"] for r in rows} == {"replay-gemini.0"}
    assert all(r["trainable"] and r["ids_source"] == "upstream" for r in rows)
    upstream = httpx.get(server.url + "/_polar/requests", timeout=10).json()
    sent = [u["body"] for u in upstream if u["path"] == "/v1/chat/completions"]
    assert sent[0]["response_format"]["json_schema"]["schema"]["type"] == "object"
    assert grep_bytes(mitm.output, [key]) == {}
