"""The Responses and Messages dialects end to end: the official `openai` / `anthropic` SDKs (and
Codex / Claude Code request bodies recorded from the real binaries) through HTTPS_PROXY and real
mitmdump + addon to the reference policy server, against every server kind."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.dialects.convert import unseal
from tests.e2e.loopback.test_capture_e2e import calls_of, wait_for_upstream_request
from tests.helpers import TESTS
from tests.helpers.broken_upstream import BrokenUpstream
from tests.helpers.clients import (
    RUN_SHELL,
    TOOL_OUTPUTS,
    grep_bytes,
    http_client,
    messages_next,
    openai_client,
    responses_next,
)
from tests.helpers.upstreams import direct_ids, expected_prompt_ids

SCENARIO = TESTS / "scenarios" / "dialects.json"
GOLDEN = TESTS / "golden"
SYSTEM = "You are a coding agent. Use run_shell."
QUESTION = "How many lines does notes.txt have?"
SHELL_PARAMS = RUN_SHELL["function"]["parameters"]
RESPONSES_TOOL = {
    "type": "function",
    "name": "run_shell",
    "description": RUN_SHELL["function"]["description"],
    "parameters": SHELL_PARAMS,
}
ANTHROPIC_TOOL = {
    "name": "run_shell",
    "description": RUN_SHELL["function"]["description"],
    "input_schema": SHELL_PARAMS,
}
FINAL_TEXT = "notes.txt has 3 lines: alpha, beta and gamma."


def responses_loop(client: openai.OpenAI, stream: bool, events: list | None = None) -> list:
    """Codex's tool loop through the SDK: up to three turns, each reply's items sent back as
    Codex does (stateless, reasoning sealed); a stream's event types go to `events`."""
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    finals = []
    for _ in range(3):
        kwargs = dict(
            model="gpt-5",
            instructions=SYSTEM,
            input=items,
            tools=[RESPONSES_TOOL],
            include=["reasoning.encrypted_content"],
            store=False,
        )
        if stream:
            with client.responses.stream(**kwargs) as s:
                if events is not None:
                    events.append([e.type for e in s])
                final = s.get_final_response()
        else:
            final = client.responses.create(**kwargs)
        assert final.status == "completed"
        finals.append(final)
        more, called = responses_next(final)
        items = items + more
        if not called:
            break
    return finals


def messages_loop(client: anthropic.Anthropic, stream: bool) -> list:
    """Claude Code's tool loop through the SDK: up to three turns, each reply sent back whole."""
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    finals = []
    for _ in range(3):
        kwargs = dict(
            model="claude-sonnet-4-5",
            max_tokens=1024,
            system=SYSTEM,
            messages=messages,
            tools=[ANTHROPIC_TOOL],
        )
        if stream:
            with client.messages.stream(**kwargs) as s:
                final = s.get_final_message()
        else:
            final = client.messages.create(**kwargs)
        finals.append(final)
        more, used = messages_next(final)
        messages = messages + more
        if not used:
            break
    return finals


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def anthropic_client(mitm, api_key: str = "polar-test.0", **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="https://api.anthropic.com",
        api_key=api_key,
        http_client=anthropic.DefaultHttpxClient(proxy=mitm.proxy(), verify=str(mitm.ca)),
        max_retries=0,
        **kw,
    )


def upstream_chats(server_url: str) -> list[dict]:
    log = httpx.get(server_url + "/_polar/requests", timeout=10).json()
    return [e["body"] for e in log if e["path"] == "/v1/chat/completions"]


def assistant(reasoning: str | None, content: str, calls: list[tuple[str, str, str]]) -> dict:
    """The chat message a model turn should become upstream (written here, not by the dialect)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    return message


def check_rows(rows, conversations, server, kind, qwen3, rollout, dialect, tools):
    """Each call's record carries the exact ids the server produced for the expected prompt."""
    assert len(rows) == len(conversations)
    for messages, row in zip(conversations, rows, strict=True):
        assert row["dialect"] == dialect and row["status"] == "completed", row["error"]
        assert row["rollout_id"] == rollout and row["purpose"] == "main"
        assert row["prompt_token_ids"] == expected_prompt_ids(qwen3, kind, messages, tools)
        # asked directly, SGLang reads prior thinking only as `reasoning_content` (the proxy's
        # SGLang upstream module renames it the same way)
        direct = (
            messages
            if kind != "sglang"
            else [
                {("reasoning_content" if k == "reasoning" else k): v for k, v in m.items()}
                for m in messages
            ]
        )
        truth = direct_ids(server.url, kind, direct, tools)
        assert row["prompt_token_ids"] == truth.prompt_ids
        assert row["output_token_ids"] == truth.output_ids
        assert row["output_logprobs"] == pytest.approx(truth.logprobs, abs=1e-6)
        assert row["count_check"] == "ok" and row["ids_source"] == "upstream"
        assert row["trainable"] is True


def check_prefix_merges(rows) -> None:
    """Each call's prompt starts with the previous call's prompt + output, token for token: the
    history the harness sent back re-renders exactly what the policy generated."""
    for before, after in zip(rows, rows[1:], strict=False):
        sampled = before["prompt_token_ids"] + before["output_token_ids"]
        assert after["prompt_token_ids"][: len(sampled)] == sampled


def check_reasoning_rendered(qwen3, row, reasoning: str) -> None:
    """The next prompt re-renders the earlier thinking as Qwen3's template does."""
    prompt = qwen3.decode(row["prompt_token_ids"])
    assert f"<think>\n{reasoning.strip()}\n</think>" in prompt


# -- OpenAI Responses -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_responses_three_turn_tool_conversation(
    make_policy_server, make_mitm, qwen3, stream, upstream_kind
):
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    client = openai_client(mitm, api_key="polar-resp.1")
    events: list[list[str]] = []
    finals = responses_loop(client, stream, events)
    assert [f.model for f in finals] == ["gpt-5"] * len(finals)

    kinds = [[i.type for i in f.output] for f in finals]
    # turn 2 has no scripted thinking, but Qwen3 renders an empty think block: vLLM hands its
    # newline back as reasoning, and it must go back upstream for the prompt to re-render
    assert kinds == [
        ["reasoning", "function_call"],
        ["reasoning", "message", "function_call"],
        ["reasoning", "message"],
    ]
    r0, c0 = finals[0].output
    r1 = finals[1].output[0]
    assert r1.content[0].text.strip() == ""
    assert r0.content[0].text.strip() == "I should look at the file first."
    assert unseal(r0.encrypted_content) == r0.content[0].text
    assert (c0.name, json.loads(c0.arguments)) == ("run_shell", {"cmd": "cat notes.txt"})
    assert finals[1].output[1].content[0].text.strip() == "Counting the lines now."
    assert finals[2].output_text.strip() == FINAL_TEXT
    if stream:
        assert events[0][:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert "response.reasoning_text.delta" in events[0]
        assert "response.function_call_arguments.delta" in events[0]
        assert events[0][-1] == "response.completed"

    # what the policy saw, written out independently of the dialect
    c1 = finals[1].output[2]
    turn1 = assistant(r0.content[0].text, "", [(c0.call_id, "run_shell", c0.arguments)])
    turn2 = assistant(
        r1.content[0].text,
        finals[1].output[1].content[0].text,
        [(c1.call_id, "run_shell", c1.arguments)],
    )
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    after1 = [
        *base,
        turn1,
        {"role": "tool", "tool_call_id": c0.call_id, "content": TOOL_OUTPUTS["cat notes.txt"]},
    ]
    after2 = [
        *after1,
        turn2,
        {"role": "tool", "tool_call_id": c1.call_id, "content": TOOL_OUTPUTS["wc -l notes.txt"]},
    ]
    rows = calls_of(mitm)
    check_rows(
        rows,
        [base, after1, after2],
        server,
        upstream_kind,
        qwen3,
        "resp.1",
        "openai_responses",
        [RUN_SHELL],
    )
    check_reasoning_rendered(qwen3, rows[1], r0.content[0].text)
    check_prefix_merges(rows)
    for final, row in zip(finals, rows, strict=True):
        assert (
            final.usage.input_tokens == row["usage_prompt_tokens"] == len(row["prompt_token_ids"])
        )
        assert final.usage.output_tokens == row["usage_completion_tokens"]
        assert row["stream"] is stream
    assert grep_bytes(mitm.output, ["polar-resp.1"]) == {}


def test_codex_conversation_with_custom_exec(make_policy_server, make_mitm, qwen3, upstream_kind):
    """Codex 0.169's recorded turn-1 body (additional_tools, custom `exec`, no auth header, proxy
    credentials for identity); the reply is a custom_tool_call; turn 2 carries it back with a
    custom_tool_call_output as Codex does, and the upstream prompt shows `exec` to the policy."""
    recorded = json.loads((GOLDEN / "codex_turn1.json").read_text())
    headers = {
        k: v for k, v in recorded["headers"].items() if k not in ("content-length", "content-type")
    }
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    url = "https://api.openai.com/v1/responses"
    body = recorded["body"]
    with http_client(mitm, user="codex-task.4") as c:
        events = sse_events(c, url, body, headers)
        types = [e["type"] for e in events]
        assert types[0] == "response.created" and types[-1] == "response.completed"
        assert "response.custom_tool_call_input.delta" in types
        assert "response.custom_tool_call_input.done" in types
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i["type"] for i in done] == ["reasoning", "custom_tool_call"]
        exec_call = done[1]
        assert exec_call["name"] == "exec" and "namespace" not in exec_call
        assert exec_call["input"].startswith("const r = await tools.exec_command(")
        usage = events[-1]["response"]["usage"]
        assert set(usage) >= {
            "input_tokens",
            "input_tokens_details",
            "output_tokens",
            "output_tokens_details",
            "total_tokens",
        }
        assert events[-1]["response"]["id"] == events[0]["response"]["id"]
        # turn 2, as Codex builds it: the stored call without namespace, output as input_text parts
        stored = {
            "type": "custom_tool_call",
            "id": exec_call["id"],
            "status": "completed",
            "call_id": exec_call["call_id"],
            "name": "exec",
            "input": exec_call["input"],
        }
        output = {
            "type": "custom_tool_call_output",
            "call_id": exec_call["call_id"],
            "output": [
                {"type": "input_text", "text": "Script completed\nOutput:\n"},
                {"type": "input_text", "text": "polar was here"},
            ],
        }
        body2 = {**body, "input": [*body["input"], done[0], stored, output]}
        events2 = sse_events(c, url, body2, headers)
    text = "".join(e["delta"] for e in events2 if e["type"] == "response.output_text.delta")
    assert text.strip() == "I created hello.txt; it says: polar was here"

    first, second = upstream_chats(server.url)
    [tool] = [t for t in first["tools"] if t["function"]["name"] == "exec"]
    assert tool["function"]["parameters"]["properties"]["input"]["type"] == "string"
    assert "lark grammar" in tool["function"]["description"]
    sent = second["messages"][-2:]
    assert json.loads(sent[0]["tool_calls"][0]["function"]["arguments"]) == {
        "input": exec_call["input"]
    }
    assert sent[1] == {
        "role": "tool",
        "tool_call_id": exec_call["call_id"],
        "content": "Script completed\nOutput:\n\npolar was here",
    }
    rows = calls_of(mitm)
    assert [(r["rollout_id"], r["rollout_source"]) for r in rows] == [
        ("codex-task.4", "proxy_auth")
    ] * 2
    assert rows[0]["session_id"] == recorded["headers"]["session-id"]
    tools = [t for t in first["tools"]]
    for row, chat in zip(rows, (first, second), strict=True):
        messages = chat["messages"]
        if upstream_kind == "sglang":  # the SGLang upstream module renamed it for its server
            messages = [
                {("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
                for m in messages
            ]
        assert row["prompt_token_ids"] == expected_prompt_ids(qwen3, upstream_kind, messages, tools)
        assert row["trainable"] is True
    check_reasoning_rendered(qwen3, rows[1], done[0]["content"][0]["text"])
    check_prefix_merges(rows)
    assert "exec" in qwen3.decode(rows[0]["prompt_token_ids"])


def sse_events(client: httpx.Client, url: str, body: dict, headers: dict) -> list[dict]:
    with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_websocket_upgrade_is_refused(make_policy_server, make_mitm):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    recorded = json.loads((GOLDEN / "codex_turn1.json").read_text())
    ws = {
        "upgrade": "websocket",
        "connection": "Upgrade",
        "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "openai-beta": "responses_websockets=2026-02-06",
    }
    with http_client(mitm) as c:
        r = c.get("https://api.openai.com/v1/responses", headers=ws)
        assert r.status_code == 426 and "WebSocket" in r.json()["error"]["message"]
        events = sse_events(
            c, "https://api.openai.com/v1/responses", recorded["body"], {"session-id": "s-1"}
        )  # the SSE fallback, same connection
        assert events[-1]["type"] == "response.completed"
    rows = calls_of(mitm)
    assert [r["dialect"] for r in rows] == ["openai_responses"]  # the upgrade left no call


# -- Anthropic Messages ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_messages_three_turn_tool_conversation(
    make_policy_server, make_mitm, qwen3, stream, upstream_kind
):
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    client = anthropic_client(mitm, api_key="polar-msg.2")
    finals = messages_loop(client, stream)
    assert [f.model for f in finals] == ["claude-sonnet-4-5"] * len(finals)

    assert [f.stop_reason for f in finals] == ["tool_use", "tool_use", "end_turn"]
    assert [[b.type for b in f.content] for f in finals] == [
        ["thinking", "tool_use"],
        ["thinking", "text", "tool_use"],
        ["thinking", "text"],
    ]
    t0, u0 = finals[0].content
    t1 = finals[1].content[0]
    assert t1.thinking.strip() == ""  # Qwen3's empty think block (see the Responses test)
    assert t0.thinking.strip() == "I should look at the file first."
    assert unseal(t0.signature) == t0.thinking
    assert (u0.name, u0.input) == ("run_shell", {"cmd": "cat notes.txt"})
    assert finals[2].content[1].text.strip() == FINAL_TEXT

    u1 = finals[1].content[2]
    turn1 = assistant(
        t0.thinking, "", [(u0.id, "run_shell", json.dumps(u0.input, separators=(",", ":")))]
    )
    turn2 = assistant(
        t1.thinking,
        finals[1].content[1].text,
        [(u1.id, "run_shell", json.dumps(u1.input, separators=(",", ":")))],
    )
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    after1 = [
        *base,
        turn1,
        {"role": "tool", "tool_call_id": u0.id, "content": TOOL_OUTPUTS["cat notes.txt"]},
    ]
    after2 = [
        *after1,
        turn2,
        {"role": "tool", "tool_call_id": u1.id, "content": TOOL_OUTPUTS["wc -l notes.txt"]},
    ]
    rows = calls_of(mitm)
    check_rows(
        rows,
        [base, after1, after2],
        server,
        upstream_kind,
        qwen3,
        "msg.2",
        "anthropic_messages",
        [RUN_SHELL],
    )
    check_reasoning_rendered(qwen3, rows[1], t0.thinking)
    check_prefix_merges(rows)
    for final, row in zip(finals, rows, strict=True):
        prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
        assert prompt == row["usage_prompt_tokens"] == len(row["prompt_token_ids"])
        assert final.usage.output_tokens == row["usage_completion_tokens"]
    assert grep_bytes(mitm.output, ["polar-msg.2"]) == {}


def test_claude_code_request_and_count_tokens(make_policy_server, make_mitm, qwen3, upstream_kind):
    """Claude Code 2.1.328's recorded body (billing system block, a system message inside
    `messages`, `display: omitted` thinking) through the proxy; count_tokens answered locally
    with the policy tokenizer, equal to the prompt the server then computes."""
    recorded = json.loads((GOLDEN / "claude_turn1.json").read_text())
    headers = {
        k: v
        for k, v in recorded["headers"].items()
        if k.lower() not in ("content-length", "content-type", "x-api-key", "accept-encoding")
    }
    headers["x-api-key"] = "polar-claude.3"
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(
        server.url, polar_upstream_kind=upstream_kind, polar_tokenizer=str(qwen3_tokenizer_dir())
    )
    body = recorded["body"]
    base = "https://api.anthropic.com"
    with http_client(mitm) as c:
        count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
        r = c.post(base + "/v1/messages/count_tokens?beta=true", json=count, headers=headers)
        assert r.status_code == 200, r.text
        counted = r.json()["input_tokens"]
        events = sse_events(c, base + "/v1/messages?beta=true", body, headers)
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    thinking = [e for e in events if e["type"] == "content_block_start"][0]["content_block"]
    assert thinking["type"] == "thinking"
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert not any(d["type"] == "thinking_delta" for d in deltas)  # display: omitted
    [sig] = [d["signature"] for d in deltas if d["type"] == "signature_delta"]
    assert unseal(sig).strip() == "I will create the file with Bash."
    tool_json = "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
    assert json.loads(tool_json)["command"].startswith("printf 'polar was here'")
    stop = [e for e in events if e["type"] == "message_delta"][0]
    assert stop["delta"]["stop_reason"] == "tool_use"

    # Claude Code asks max_tokens=128000, which fits the model's 131072 context but not beside
    # the prompt: vLLM 0.33 clamps it (one request, the cap kept); SGLang refuses it, and the
    # proxy asks again without the cap (= the clamp)
    chats = upstream_chats(server.url)
    if upstream_kind == "vllm":
        [chat] = chats
        assert chat["max_tokens"] == 128000
    else:
        refused, chat = chats
        assert refused["max_tokens"] == 128000 and "max_tokens" not in chat
        assert {k: v for k, v in refused.items() if k != "max_tokens"} == chat
    assert "x-anthropic-billing-header" not in json.dumps(chat)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system"]
    local, row = calls_of(mitm)
    assert (local["route"], local["purpose"], local["status"]) == (
        "local",
        "count_tokens",
        "completed",
    )
    assert local["ids_source"] == "none" and local["trainable"] is False
    assert counted == len(row["prompt_token_ids"])  # the tokenizer's count is the server's prompt
    assert row["rollout_id"] == "claude.3" and row["purpose"] == "main"
    assert row["session_id"] == recorded["headers"]["X-Claude-Code-Session-Id"]
    assert row["translation_notes"][0] == "dropped system[0]: x-anthropic-billing-header: block"
    dropped = (
        "max_tokens=128000 dropped: the server refused it as it exceeds the model's context "
        "(alone or beside the prompt)"
    )
    assert (row["translation_notes"][-1] == dropped) is (upstream_kind == "sglang")
    assert row["trainable"] is True
    assert grep_bytes(mitm.output, ["polar-claude.3"]) == {}


# -- both dialects ---------------------------------------------------------------------------------

LIVE = {
    "openai_responses": (
        "/v1/responses",
        {"model": "m", "stream": True, "input": "HOLD please"},
        "response.output_text.delta",
        lambda e: e["delta"],
    ),
    "anthropic_messages": (
        "/v1/messages",
        {
            "model": "m",
            "stream": True,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "HOLD please"}],
        },
        "content_block_delta",
        lambda e: e["delta"].get("text", ""),
    ),
}


@pytest.mark.parametrize("dialect", list(LIVE))
def test_streaming_is_live(make_policy_server, make_mitm, upstream_kind, dialect):
    """As the capture path's test: the server holds its last chunk until the harness has read
    the first text delta (vLLM), or holds the whole reply (SGLang, which cannot stream ids)."""
    path, body, kind, text_of = LIVE[dialect]
    host = "api.openai.com" if dialect == "openai_responses" else "api.anthropic.com"
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    first_text = threading.Event()
    result: dict = {}

    def read() -> None:
        with (
            http_client(mitm) as c,
            c.stream(
                "POST", f"https://{host}{path}", json=body, headers={"x-api-key": "polar-live.0"}
            ) as r,
        ):
            text = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == kind:
                        text.append(text_of(event))
                        first_text.set()
                    result["last"] = event["type"]
            result["text"] = "".join(text)
            result["done_at"] = time.monotonic()

    reader = threading.Thread(target=read)
    reader.start()
    if upstream_kind == "sglang":
        wait_for_upstream_request(server.url)
        assert not first_text.is_set()
        released_at = time.monotonic()
        assert (
            httpx.post(server.url + "/_polar/release?wait=20", timeout=30).json()["released"] == 1
        )
    else:
        assert first_text.wait(20), "the first text delta did not arrive before the last chunk"
        released_at = time.monotonic()
        httpx.post(server.url + "/_polar/release", timeout=10).raise_for_status()
    reader.join(30)
    assert result["text"].strip() == "one two three four five six seven eight nine ten"
    assert result["done_at"] >= released_at
    assert result["last"] in ("response.completed", "message_stop")
    [row] = calls_of(mitm)
    assert row["status"] == "completed" and row["dialect"] == dialect and row["trainable"] is True


def reply_parts(final: Any) -> list[tuple]:
    """What a harness reads in a final Responses / Messages reply, without its random ids."""
    if hasattr(final, "output"):
        return [
            (i.type, i.name, i.arguments)
            if i.type == "function_call"
            else (i.type, i.content[0].text)
            for i in final.output
        ]
    return [
        (b.type, b.name, b.input)
        if b.type == "tool_use"
        else (b.type, b.thinking if b.type == "thinking" else b.text)
        for b in final.content
    ]


def same_when_merged(
    make_policy_server, make_mitm, upstream_kind: str, run: Callable[[Any, str], Any]
) -> None:
    """vLLM merges the deltas its HTTP side has not sent yet into one chunk
    (``RequestOutputCollector.put``, vllm/v1/engine/output_processor.py): on a busy machine a
    whole reply, thinking, text and tool call together, can come as one delta. `run(mitm, key)`
    plays a harness's tool loop and returns what it read; that, and the tokens the proxy
    recorded, must be the same from a server sending one token per chunk and from one sending
    each reply whole (checked: its streams come in fewer chunks)."""
    seen, events = [], []
    for chunk_tokens in ("1", "4096"):
        server = make_policy_server(SCENARIO, "--chunk-tokens", chunk_tokens, kind=upstream_kind)
        mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
        read = run(mitm, f"polar-merged{chunk_tokens}.0")
        rows = calls_of(mitm)
        assert [r["status"] for r in rows] == ["completed"] * 3
        seen.append((read, [r["output_token_ids"] for r in rows]))
        # turn 2 (thinking, text and a tool call) asked again, straight: how many chunks
        turn2 = upstream_chats(server.url)[1]
        assert turn2.get("stream") is True, turn2
        reply = httpx.post(server.url + "/v1/chat/completions", json=turn2, timeout=60).text
        events.append(sum(line.startswith("data: ") for line in reply.splitlines()))
    assert events[1] < events[0], events
    assert seen[0] == seen[1]


@pytest.mark.parametrize("dialect", ["openai_responses", "anthropic_messages"])
def test_a_whole_reply_in_one_chunk(make_policy_server, make_mitm, upstream_kind, dialect):
    """same_when_merged, for the Responses and Messages harnesses."""

    def run(mitm, key: str) -> list[list[tuple]]:
        if dialect == "openai_responses":
            finals = responses_loop(openai_client(mitm, api_key=key), stream=True)
        else:
            finals = messages_loop(anthropic_client(mitm, api_key=key), stream=True)
        return [reply_parts(f) for f in finals]

    same_when_merged(make_policy_server, make_mitm, upstream_kind, run)


def test_bad_requests_get_the_dialect_error(make_policy_server, make_mitm):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    oai = openai_client(mitm, api_key="polar-bad.0")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input=[{"type": "local_shell_call", "call_id": "c"}])
    assert "'local_shell_call' is not supported" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="m", input="x", previous_response_id="resp_1")
    ant = anthropic_client(mitm, api_key="polar-bad.0")
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(
            model="m",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "search_result", "source": "x", "title": "t", "content": []}
                    ],
                }
            ],
        )
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.body["error"]["message"]},
    }
    assert "'search_result' is not supported" in e.value.body["error"]["message"]
    with http_client(mitm) as c:
        r = c.post(
            "https://api.anthropic.com/v1/messages",
            content=b"{not json",
            headers={"x-api-key": "polar-bad.0"},
        )
        assert r.status_code == 400 and r.json()["type"] == "error"
    rows = calls_of(mitm)
    assert [(r["dialect"], r["status"], r["http_status"]) for r in rows] == [
        ("openai_responses", "error", 400),
        ("openai_responses", "error", 400),
        ("anthropic_messages", "error", 400),
        ("anthropic_messages", "error", 400),
    ]


def test_upstream_failure_mid_stream_ends_with_the_dialect_error(make_mitm):
    """The upstream sends a few chunks and closes: Responses ends with `response.failed` under the
    id it was created with; Anthropic with an `error` event, which the SDK raises."""
    broken = BrokenUpstream()
    try:
        mitm = make_mitm(broken.url, polar_model="Qwen/Qwen3-4B")
        with http_client(mitm) as c:
            events = sse_events(
                c,
                "https://api.openai.com/v1/responses",
                {"model": "m", "stream": True, "input": "hi"},
                {},
            )
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["id"] == events[0]["response"]["id"]
        assert "ended the stream" in events[-1]["response"]["error"]["message"]
        assert "".join(e.get("delta", "") for e in events) == "half a reply"
        client = anthropic_client(mitm)
        with (
            pytest.raises(anthropic.APIStatusError, match="ended the stream"),
            client.messages.stream(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            ) as s,
        ):
            for _ in s:
                pass
        rows = calls_of(mitm)
    finally:
        broken.stop()
    assert [(r["dialect"], r["status"]) for r in rows] == [
        ("openai_responses", "error"),
        ("anthropic_messages", "error"),
    ]
    assert all("ended the stream" in r["error"] for r in rows)
