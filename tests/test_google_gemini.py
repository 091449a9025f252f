"""Google's Gemini API dialect without processes: request translation (Gemini bodies and the
chat-completions bodies they become, written out here), refusals, errors, countTokens, identity,
and the reply stream as the `@google/genai` SDK reads it (its SSE line pattern, from the SDK
Gemini CLI 0.61 bundles)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from mitmproxy.http import Headers, Request

from polar_mitm.addons.capture import _drop_polar_keys
from polar_mitm.call.identity import resolve
from polar_mitm.dialects import DialectError, by_name, detect
from polar_mitm.dialects.convert import seal, unseal
from polar_mitm.dialects.gemini_config import json_schema

GEMINI = by_name("google_gemini")
STREAM = "/v1beta/models/gemini-2.5-pro:streamGenerateContent"
GENERATE = "/v1beta/models/gemini-2.5-pro:generateContent"
COUNT = "/v1beta/models/gemini-2.5-pro:countTokens"
FIXTURES = Path(__file__).parent / "fixtures" / "harness" / "gemini"
SHELL = {
    "name": "run_shell_command",
    "description": "Run a shell command.",
    "parametersJsonSchema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
# The @google/genai SDK's own pattern for one SSE event (ApiClient.processStreamResponse).
SDK_EVENT = re.compile(r"^\s*data: (.*)(?:\n\n|\r\r|\r\n\r\n)")


def parse(body: dict[str, Any], path: str = STREAM):
    return GEMINI.parse(json.dumps(body).encode(), path)


def user(*parts: dict) -> dict:
    return {"role": "user", "parts": list(parts)}


def model(*parts: dict) -> dict:
    return {"role": "model", "parts": list(parts)}


def chat_fn(name: str, parameters: Any, description: str | None = None) -> dict:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def sdk_events(data: bytes, cut: int = 7) -> list[dict]:
    """Our bytes read as the SDK reads them: arbitrary network pieces into a buffer, one event
    per match of its pattern, nothing left over at the end."""
    buffer, events = "", []
    for i in range(0, len(data), cut):
        buffer += data[i : i + cut].decode()
        while match := SDK_EVENT.match(buffer):
            events.append(json.loads(match[1]))
            buffer = buffer[match.end() :]
    assert buffer.strip() == "", buffer
    return events


# -- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "found"),
    [
        ("POST", STREAM, True),
        ("POST", GENERATE, True),
        ("POST", COUNT, True),
        ("POST", "/v1/models/gemini-2.0-flash:generateContent", True),
        (
            "POST",
            "/v1beta1/projects/p/locations/l/publishers/google/models/m:generateContent",
            True,
        ),
        ("POST", "/v1beta/models/text-embedding-004:embedContent", False),
        ("GET", "/v1beta/models/gemini-2.5-pro", False),
        ("GET", STREAM, False),
    ],
)
def test_detect(method, path, found):
    dialect = detect(method, path)
    assert (dialect is GEMINI) is found
    if not found:
        assert dialect is None


@pytest.mark.parametrize(
    ("path", "query", "refused"),
    [
        (STREAM, {"alt": "sse"}, None),
        (STREAM, {}, "add ?alt=sse"),
        (STREAM, {"alt": "json"}, "add ?alt=sse"),
        (GENERATE, {}, None),
        (GENERATE, {"alt": "json", "key": "polar-x"}, None),
        (GENERATE, {"alt": "proto"}, "alt='proto' is not supported"),
    ],
)
def test_query(path, query, refused):
    why = GEMINI.refuse_query(path, query)
    assert (why is None) if refused is None else (refused in why)


# -- requests ----------------------------------------------------------------------------------


def test_a_tool_conversation_becomes_chat():
    thinking = "I should list the files."
    body = {
        "systemInstruction": {"parts": [{"text": "Be brief."}, {"text": "Use tools."}]},
        "contents": [
            user({"text": "<session_context>ctx</session_context>"}, {"text": "List files."}),
            model(
                {"text": thinking, "thought": True},
                {"text": "Listing "},
                {"text": "now."},
                {"functionCall": {"id": "c1", "name": "run_shell_command", "args": {"command": "ls"}}},
            ),
            user({"functionResponse": {"id": "c1", "name": "run_shell_command", "response": {"output": "a.txt"}}}),
            model({"text": "There is a.txt."}),
            user({"text": "Thanks"}, {"inlineData": {"mimeType": "image/png", "data": "iVBO"}}),
        ],
        "tools": [{"functionDeclarations": [SHELL]}],
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {
            "temperature": 1,
            "topP": 0.95,
            "topK": 64,
            "maxOutputTokens": 512,
            "stopSequences": ["END"],
            "seed": 7,
            "thinkingConfig": {"includeThoughts": True, "thinkingLevel": "HIGH"},
        },
    }  # fmt: skip
    req = parse(body)
    assert (req.model, req.stream, req.local, req.purpose) == (
        "gemini-2.5-pro",
        True,
        False,
        "main",
    )
    assert req.notes == [] and req.extra == {"show_thoughts": True}
    assert req.chat == {
        "messages": [
            {"role": "system", "content": "Be brief.\nUse tools."},
            {"role": "user", "content": "<session_context>ctx</session_context>\nList files."},
            {
                "role": "assistant",
                "content": "Listing now.",
                "reasoning": thinking,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            {"role": "assistant", "content": "There is a.txt."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Thanks"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                ],
            },
        ],
        "tools": [chat_fn("run_shell_command", SHELL["parametersJsonSchema"], "Run a shell command.")],
        "tool_choice": "auto",
        "max_tokens": 512,
        "temperature": 1,
        "top_p": 0.95,
        "top_k": 64,
        "seed": 7,
        "stop": ["END"],
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }  # fmt: skip


def test_sealed_signature_is_the_thinking_gemini_cli_dropped():
    """Gemini CLI sends no thought parts back, only the signatures: ours carry the thinking."""
    call = {"name": "run_shell_command", "args": {"command": "ls"}}
    sealed = model({"functionCall": call, "thoughtSignature": seal("Let me look.")})
    synthetic = model(
        {"functionCall": call, "thoughtSignature": "skip_thought_signature_validator"}
    )
    answer = {"functionResponse": {"name": "run_shell_command", "response": {"output": "x"}}}
    for turn, reasoning in ((sealed, "Let me look."), (synthetic, None)):
        req = parse({"contents": [user({"text": "hi"}), turn, user(answer)]})
        assistant = req.chat["messages"][1]
        assert assistant.get("reasoning") == reasoning


def test_calls_without_ids_pair_by_name_in_order_with_stable_ids():
    def call(name: str, n: int) -> dict:
        return {"functionCall": {"name": name, "args": {"n": n}}}

    def answer(name: str, out: str) -> dict:
        return {"functionResponse": {"name": name, "response": {"result": out}}}

    body = {
        "contents": [
            user({"text": "go"}),
            model(call("a", 1), call("b", 2), call("a", 3)),
            user(answer("b", "B"), answer("a", "A1"), answer("a", "A3"), {"text": "and?"}),
        ]
    }
    messages = parse(body).chat["messages"]
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert ids == ["call_1", "call_2", "call_3"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:5]] == [
        ("call_2", '{"result":"B"}'),  # not {"output": str}: the whole response as JSON
        ("call_1", '{"result":"A1"}'),
        ("call_3", '{"result":"A3"}'),
    ]
    assert messages[5] == {"role": "user", "content": "and?"}
    # a longer history of the same conversation names its calls the same way
    longer = {**body, "contents": [*body["contents"], model({"text": "done"})]}
    assert [c["id"] for c in parse(longer).chat["messages"][1]["tool_calls"]] == ids


def test_schemas_spellings_and_tool_config():
    google_schema = {
        "type": "OBJECT",
        "properties": {
            "paths": {"type": "ARRAY", "items": {"type": "STRING", "enum": ["A", "B"]}},
            "type": {"type": "STRING", "description": "a property called type"},
        },
        "required": ["paths"],
    }
    body = {
        "system_instruction": {"parts": {"text": "sys"}},  # snake_case, one part as an object
        "contents": {"parts": [{"text": "hi"}]},  # one Content, role left out: user
        "tools": [
            {"function_declarations": [{"name": "pick", "parameters": google_schema}]},
            {"functionDeclarations": [{"name": "noargs"}]},
        ],
        "tool_config": {
            "function_calling_config": {"mode": "ANY", "allowed_function_names": ["pick"]}
        },
        "generation_config": {"max_output_tokens": 9, "thinking_config": {"thinking_budget": 0}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    req = parse(body, GENERATE)
    assert req.stream is False
    assert req.chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    lowered = {
        "type": "object",
        "properties": {
            "paths": {"type": "array", "items": {"type": "string", "enum": ["A", "B"]}},
            "type": {"type": "string", "description": "a property called type"},
        },
        "required": ["paths"],
    }
    assert req.chat["tools"] == [chat_fn("pick", lowered), chat_fn("noargs", {"type": "object"})]
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "pick"}}
    assert req.chat["max_tokens"] == 9
    assert req.chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert req.notes == ["ignored safetySettings"]
    assert json_schema(lowered) == lowered  # a valid JSON Schema is left as it is


@pytest.mark.parametrize(
    ("config", "choice", "note"),
    [
        ({"mode": "NONE"}, "none", None),
        ({"mode": "ANY"}, "required", None),
        ({"mode": "ANY", "allowedFunctionNames": ["a", "b"]}, "required", "not enforced"),
        ({"mode": "VALIDATED"}, "auto", "VALIDATED sent as auto"),
    ],
)
def test_function_calling_modes(config, choice, note):
    body = {
        "contents": [user({"text": "x"})],
        "tools": [{"functionDeclarations": [SHELL]}],
        "toolConfig": {"functionCallingConfig": config},
    }
    req = parse(body)
    assert req.chat["tool_choice"] == choice
    assert (note is None and req.notes == []) or (note in req.notes[0])


def test_json_output_and_ignored_config():
    body = {
        "contents": [user({"text": "rate it"})],
        "generationConfig": {
            "responseMimeType": "application/json",
            "responseJsonSchema": {"type": "OBJECT", "properties": {"n": {"type": "INTEGER"}}},
            "responseLogprobs": True,
            "mediaResolution": "MEDIA_RESOLUTION_LOW",
            "candidateCount": 1,
        },
    }
    req = parse(body, GENERATE)
    assert req.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": "response",
            "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
        },
    }
    assert req.notes == [
        "ignored generationConfig.mediaResolution",
        "responseLogprobs not returned (the record has the logprobs)",
    ]
    plain = {
        "contents": body["contents"],
        "generationConfig": {"responseMimeType": "application/json"},
    }
    assert parse(plain).chat["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "'contents' is required"),
        ({"contents": []}, "'contents' is required"),
        ({"contents": "hi"}, "'contents' must be a list"),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "role must be 'user' or 'model'"),
        ({"contents": [{"parts": ["x"]}]}, "contents[0].parts[0] must be an object"),
        ({"contents": [user({"banana": 1})]}, "contents[0].parts[0] has none of text"),
        ({"contents": [user({"text": 5})]}, "contents[0].parts[0].text must be a string"),
        ({"contents": [user({"fileData": {"fileUri": "gs://b/f"}})]}, "fileData parts are not supported"),
        ({"contents": [user({"inlineData": {"mimeType": "audio/wav", "data": "AA"}})]}, "only inlineData images"),
        ({"contents": [model({"executableCode": {"code": "1"}})]}, "executableCode parts in a model turn"),
        ({"contents": [model({"functionCall": {"args": {}}})]}, "functionCall needs a string 'name'"),
        ({"contents": [model({"functionCall": {"name": "f", "args": [1]}})]}, "args must be an object"),
        ({"contents": [user({"text": "x"})], "tools": [{"googleSearch": {}}]}, "Google tool 'googleSearch'"),
        ({"contents": [user({"text": "x"})], "tools": [{"codeExecution": {}}]}, "nothing behind polar-mitm"),
        ({"contents": [user({"text": "x"})], "cachedContent": "cachedContents/1"}, "'cachedContent' is not supported"),
        ({"contents": [user({"text": "x"})], "generationConfig": {"candidateCount": 2}}, "'candidateCount' must be 1"),
        ({"contents": [user({"text": "x"})], "generationConfig": {"temperature": 3}}, "'temperature' must be a number between 0 and 2"),
        ({"contents": [user({"text": "x"})], "generationConfig": {"maxOutputTokens": 0}}, "'maxOutputTokens' must be a positive integer"),
        ({"contents": [user({"text": "x"})], "generationConfig": {"responseModalities": ["IMAGE"]}}, "'responseModalities' must be TEXT"),
        ({"contents": [user({"text": "x"})], "generationConfig": {"responseMimeType": "text/x.enum"}}, "'responseMimeType' 'text/x.enum'"),
        ({"contents": [user({"text": "x"})], "generationConfig": "hot"}, "'generationConfig' must be an object"),
        ({"contents": [user({"text": "x"})], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}}, "mode' 'SOMETIMES' is not supported"),
        ({"contents": [user({"functionResponse": {"name": "f", "parts": [{"inlineData": {}}]}})]}, "multimodal"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(body, needle):
    with pytest.raises(DialectError) as e:
        parse(body)
    assert needle in e.value.message and e.value.status == 400


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies(raw):
    with pytest.raises(DialectError) as e:
        GEMINI.parse(raw, STREAM)
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("status", "kind", "code", "name"),
    [
        (400, "invalid_request_error", 400, "INVALID_ARGUMENT"),
        (404, "invalid_request_error", 404, "NOT_FOUND"),
        (413, "invalid_request_error", 413, "INVALID_ARGUMENT"),
        (429, "rate_limit_error", 429, "RESOURCE_EXHAUSTED"),
        (500, "server_error", 500, "INTERNAL"),
        (502, "server_error", 502, "UNAVAILABLE"),
        (418, "invalid_request_error", 418, "INVALID_ARGUMENT"),
        (0, "rate_limit_error", 429, "RESOURCE_EXHAUSTED"),  # mid-stream: from the kind
        (0, "server_error", 500, "INTERNAL"),
    ],
)
def test_error_shape(status, kind, code, name):
    body = json.loads(GEMINI.error_bytes(status, "boom", kind))
    assert body == {"error": {"code": code, "message": "boom", "status": name}}


# -- purposes, countTokens ---------------------------------------------------------------------

CLI_CONTEXT = user(
    {"text": "<session_context>\nThis is the Gemini CLI. We are setting up.</session_context>"}
)


@pytest.mark.parametrize(
    ("contents", "tools", "purpose"),
    [
        ([CLI_CONTEXT, user({"text": "task"})], True, "main"),
        ([CLI_CONTEXT, user({"text": "task"})], False, "side"),  # its router, next-speaker checks
        ([CLI_CONTEXT, model({"text": "did"}), user({"text": "Generate a new <state_snapshot> now."})], False, "compaction"),
        ([user({"text": "plain chat, no tools"})], False, "main"),  # not Gemini CLI: its own loop
    ],
)  # fmt: skip
def test_purpose(contents, tools, purpose):
    body: dict[str, Any] = {"contents": contents}
    if tools:
        body["tools"] = [{"functionDeclarations": [SHELL]}]
    assert parse(body).purpose == purpose


@pytest.mark.parametrize("wrapped", [False, True])
def test_count_tokens_is_local(wrapped):
    inner = {
        "contents": [user({"text": "hi"})],
        "systemInstruction": {"parts": [{"text": "sys"}]},
        "generationConfig": {"maxOutputTokens": 5},
    }
    body = (
        {"generateContentRequest": {"model": "models/gemini-2.5-pro", **inner}}
        if wrapped
        else inner
    )
    req = parse(body, COUNT)
    assert req.local and req.purpose == "count_tokens" and not req.stream
    assert "max_tokens" not in req.chat  # a count has no output cap
    assert req.chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]

    class Counter:
        def prompt_tokens(self, chat):
            assert chat == req.chat
            return 42

    assert GEMINI.local_reply(req, Counter()) == {"totalTokens": 42}


def test_gemini_cli_recorded_requests():
    """What Gemini CLI 0.61.0 sent (tests/fixtures/harness/gemini/): its router's call is a side
    call with JSON output (its upper-case schema lowered); the agent loop's second call carries
    the tool call with its id and the shell output as the tool message."""
    entries = sorted(
        (json.loads(p.read_text()) for p in FIXTURES.glob("*-generativelanguage*.json")),
        key=lambda e: e["seq"],
    )
    router, first, second = (
        GEMINI.parse(json.dumps(e["body"]).encode(), e["path"].partition("?")[0]) for e in entries
    )
    assert (router.purpose, router.stream, router.chat.get("tools")) == ("side", False, None)
    schema = router.chat["response_format"]["json_schema"]["schema"]
    assert (
        schema["type"] == "object" and schema["properties"]["complexity_score"]["type"] == "integer"
    )
    assert (first.purpose, first.stream) == ("main", True)
    assert "run_shell_command" in [t["function"]["name"] for t in first.chat["tools"]]
    assert first.chat["chat_template_kwargs"] == {"reasoning_effort": "high"}
    assistant, tool = second.chat["messages"][-2:]
    [call] = assistant["tool_calls"]
    assert json.loads(call["function"]["arguments"])["command"].startswith(
        "printf 'polar was here'"
    )
    assert tool["tool_call_id"] == call["id"] and "polar was here" in tool["content"]
    assert second.chat["messages"][:-2] == first.chat["messages"]
    assert [first.notes, second.notes] == [[], []]  # the agent loop loses nothing


# -- identity ----------------------------------------------------------------------------------


def test_google_keys_identify_the_rollout():
    r = resolve(Headers(x_goog_api_key="polar-gem.4"), "10.0.0.1", None)
    assert (r.rollout_id, r.source, r.group_id, r.sample_index) == ("gem.4", "api_key", "gem", 4)
    r = resolve(Headers(), "10.0.0.1", None, query_key="polar-q.1")
    assert (r.rollout_id, r.source) == ("q.1", "api_key")
    # the header's polar- key first; a real key in either place identifies nothing
    assert resolve(Headers(x_goog_api_key="polar-h.1"), "h", None, "polar-q.1").rollout_id == "h.1"
    assert (
        resolve(Headers(x_goog_api_key="AIzaSy-real"), "h", None, "AIza").source == "client_address"
    )
    assert resolve(Headers(x_goog_api_key="polar-h.1"), "h", "proxy.0").rollout_id == "proxy.0"


def test_polar_keys_never_go_to_the_real_host():
    """polar_other_paths=pass: every polar- key is taken out, in any key header or ?key=; real
    keys beside them go on."""
    url = "https://generativelanguage.googleapis.com/v1beta/files?key=polar-q.1&alt=json"
    headers = {
        "authorization": "Bearer polar-a.1",
        "x-goog-api-key": "polar-g.1",
        "x-api-key": "sk-real",
        "user-agent": "GeminiCLI",
    }
    request = Request.make("GET", url, headers=headers)
    _drop_polar_keys(request)
    kept = {k: v for k, v in request.headers.items() if k != "content-length"}
    assert kept == {"x-api-key": "sk-real", "user-agent": "GeminiCLI"}
    assert request.path == "/v1beta/files?alt=json"
    real = Request.make(
        "GET", url.replace("polar-q.1", "AIza-real"), headers={"x-goog-api-key": "AIza"}
    )
    _drop_polar_keys(real)
    assert real.query["key"] == "AIza-real" and real.headers["x-goog-api-key"] == "AIza"


# -- replies -----------------------------------------------------------------------------------


def chunk(delta: dict | None = None, finish: str | None = None) -> dict:
    return {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }


def tool(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict:
    call: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id:
        call.update(id=id, type="function")
        call["function"]["name"] = name
    return chunk({"tool_calls": [call]})


USAGE = {
    "id": "chatcmpl-1",
    "choices": [],
    "usage": {
        "prompt_tokens": 11,
        "completion_tokens": 9,
        "completion_tokens_details": {"reasoning_tokens": 4},
        "prompt_tokens_details": {"cached_tokens": 3},
    },
}


def turn() -> list[dict]:
    """Reasoning, vLLM's separator as content, text, then two function calls in pieces."""
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Let me"}),
        chunk({"reasoning": " think."}),
        chunk({"content": "\n\n"}),
        chunk({"content": "Running "}),
        chunk({"content": "it.\n"}),
        tool(0, id="chatcmpl-tool-a", name="run_shell_command", args='{"command": '),
        tool(0, args='"ls -la"}'),
        tool(1, id="bad id!", name="read_file", args='{"file_path": "a"}'),
        chunk({}, "tool_calls"),
        USAGE,
    ]


def request(**config: Any):
    body = {"contents": [user({"text": "hi"})], "tools": [{"functionDeclarations": [SHELL]}]}
    if config:
        body["generationConfig"] = config
    return parse(body)


def test_stream_as_the_sdk_reads_it():
    req = request(thinkingConfig={"includeThoughts": True})
    translator = GEMINI.stream(req)
    data = b"".join(translator.chunk(c) for c in turn()) + translator.finish()
    events = sdk_events(data)
    assert len({e["responseId"] for e in events}) == 1
    assert {e["modelVersion"] for e in events} == {"gemini-2.5-pro"}
    parts = [p for e in events for p in e["candidates"][0]["content"]["parts"]]
    sig = seal("Let me think.")
    assert parts == [
        {"text": "Let me", "thought": True},
        {"text": " think.", "thought": True},
        {"text": "\n\nRunning", "thoughtSignature": sig},  # the first part after the thinking
        {"text": " it."},  # the "\n" before the calls is the template's: dropped
        {"functionCall": {"id": "chatcmpl-tool-a", "name": "run_shell_command", "args": {"command": "ls -la"}}},
        {"functionCall": {"id": parts[5]["functionCall"]["id"], "name": "read_file", "args": {"file_path": "a"}}},
    ]  # fmt: skip
    assert re.fullmatch(r"call_[0-9a-f]{24}", parts[5]["functionCall"]["id"])  # "bad id!" replaced
    last = events[-1]
    assert last["candidates"][0] == {
        "content": {"role": "model", "parts": []},
        "finishReason": "STOP",
        "index": 0,
    }
    assert last["usageMetadata"] == {
        "promptTokenCount": 11,
        "candidatesTokenCount": 5,
        "totalTokenCount": 20,
        "thoughtsTokenCount": 4,
        "cachedContentTokenCount": 3,
    }
    assert all("finishReason" not in e["candidates"][0] for e in events[:-1])


def test_thoughts_hidden_unless_asked_but_always_sealed():
    translator = GEMINI.stream(request())
    events = sdk_events(b"".join(translator.chunk(c) for c in turn()) + translator.finish())
    parts = [p for e in events for p in e["candidates"][0]["content"]["parts"]]
    assert not any(p.get("thought") for p in parts)
    assert unseal(parts[0]["thoughtSignature"]) == "Let me think."


def test_each_chunk_is_sent_at_once():
    translator = GEMINI.stream(request(thinkingConfig={"includeThoughts": True}))
    assert translator.chunk(chunk({"reasoning": "hm"})) != b""
    assert translator.chunk(chunk({"content": "Hello"})) != b""
    assert (
        translator.chunk(tool(0, id="c", name="run_shell_command", args="{")) == b""
    )  # whole calls
    assert translator.chunk(tool(0, args="}")) == b""
    assert translator.chunk(chunk({}, "tool_calls")) == b""
    assert b'"functionCall"' in translator.finish()  # the last call, once the stream has ended


@pytest.mark.parametrize(
    ("finish", "reason"),
    [("stop", "STOP"), ("length", "MAX_TOKENS"), ("content_filter", "SAFETY"), ("weird", "OTHER")],
)
def test_finish_reasons(finish, reason):
    translator = GEMINI.stream(request())
    data = translator.chunk(chunk({"content": "x"}, finish)) + translator.finish()
    assert sdk_events(data)[-1]["candidates"][0]["finishReason"] == reason


@pytest.mark.parametrize("args", ['{"command": "ls"', "[1, 2]", "not json"])
def test_unparseable_call_is_a_malformed_function_call(args):
    translator = GEMINI.stream(request())
    chunks = [tool(0, id="c", name="run_shell_command", args=args), chunk({}, "tool_calls")]
    events = sdk_events(b"".join(translator.chunk(c) for c in chunks) + translator.finish())
    assert [e["candidates"][0]["finishReason"] for e in events] == ["MALFORMED_FUNCTION_CALL"]
    assert events[0]["candidates"][0]["content"]["parts"] == []


def test_thinking_alone_signs_an_empty_text_part():
    translator = GEMINI.stream(request())
    data = translator.chunk(chunk({"reasoning": "hmm"}, "stop")) + translator.finish()
    parts = [p for e in sdk_events(data) for p in e["candidates"][0]["content"]["parts"]]
    assert parts == [{"text": "", "thoughtSignature": seal("hmm")}]


def test_failure_mid_stream_ends_with_googles_error():
    translator = GEMINI.stream(request())
    data = translator.chunk(chunk({"content": "half"})) + translator.fail("upstream died")
    events = sdk_events(data)
    assert events[-1] == {"error": {"code": 500, "message": "upstream died", "status": "INTERNAL"}}


def test_whole_reply():
    req = request(thinkingConfig={"includeThoughts": True})
    reply = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "reasoning": "Because.",
                    "content": "Done.",
                    "tool_calls": [
                        {"id": "t1", "type": "function", "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    }  # fmt: skip
    out = GEMINI.reply(req, reply)
    assert out["candidates"] == [
        {
            "content": {
                "role": "model",
                "parts": [
                    {"text": "Because.", "thought": True},
                    {"text": "Done.", "thoughtSignature": seal("Because.")},
                    {"functionCall": {"id": "t1", "name": "run_shell_command", "args": {"command": "ls"}}},
                ],
            },
            "finishReason": "STOP",
            "index": 0,
        }
    ]  # fmt: skip
    assert out["usageMetadata"] == {
        "promptTokenCount": 5,
        "candidatesTokenCount": 3,
        "totalTokenCount": 8,
    }
    assert out["modelVersion"] == "gemini-2.5-pro" and out["responseId"]
    # sent back as Gemini CLI does (thoughts dropped), the turn is the chat message it came from
    back = parse(
        {"contents": [user({"text": "hi"}), model(*out["candidates"][0]["content"]["parts"][1:])]}
    )
    assert back.chat["messages"][1] == {
        "role": "assistant",
        "content": "Done.",
        "reasoning": "Because.",
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'}}],
    }  # fmt: skip
