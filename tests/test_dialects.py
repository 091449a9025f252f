"""The Responses and Messages dialects without processes: request translation (golden tables of
harness bodies and the chat-completions bodies they become), and reply translation checked by
the official SDKs' own stream accumulators (fed our bytes through an in-memory transport)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.dialects import DialectError, by_name, detect
from polar_mitm.dialects.assemble import reply_to_chunks
from polar_mitm.dialects.convert import seal, unseal
from polar_mitm.dialects.responses_stream import _InputDecoder, custom_input

RESPONSES = by_name("openai_responses")
MESSAGES = by_name("anthropic_messages")
GOLDEN = Path(__file__).parent / "golden"
SHELL_SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
CUSTOM_SCHEMA = {
    "type": "object",
    "properties": {
        "input": {
            "type": "string",
            "description": "The tool's whole input, as free text (not JSON).",
        }
    },
    "required": ["input"],
    "additionalProperties": False,
}


def golden(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text())


def parse(dialect, body: dict[str, Any], path: str):
    return dialect.parse(json.dumps(body).encode(), path)


def fn(name: str, parameters: Any = None, description: str | None = None, **extra: Any) -> dict:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object"}
    function.update(extra)
    return {"type": "function", "function": function}


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "name"),
    [
        ("POST", "/v1/responses", "openai_responses"),
        ("POST", "/backend-api/codex/responses", "openai_responses"),
        ("POST", "/v1/messages", "anthropic_messages"),
        ("POST", "/anthropic/v1/messages/count_tokens", "anthropic_messages"),
        ("POST", "/v1/chat/completions", "openai_chat"),
        ("GET", "/v1/responses", None),
        ("POST", "/v1/threads/abc/messages", None),  # OpenAI's Assistants API, not Anthropic
        ("POST", "/v1/responses/compact", "openai_responses"),  # compaction (docs/dialects.md)
    ],
)
def test_detect(method, path, name):
    dialect = detect(method, path)
    assert (dialect.name if dialect else None) == name


# -- Responses requests: golden table ------------------------------------------------------------

RESPONSES_CASES = [
    pytest.param(
        {
            "model": "gpt-5",
            "instructions": "Be brief.",
            "input": "hi",
            "temperature": 0.5,
            "top_p": 0.9,
            "max_output_tokens": 64,
            "store": False,
            "prompt_cache_key": "k",
            "text": {"verbosity": "low"},
            "client_metadata": {"x": "y"},
            "some_future_field": {"a": 1},
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 64,
            "temperature": 0.5,
            "top_p": 0.9,
        },
        id="string-input-and-sampling",
    ),
    pytest.param(
        {
            "model": "gpt-5",
            "input": [
                {"role": "developer", "content": "dev rules"},
                {
                    "type": "message",
                    "role": "system",
                    "content": [{"type": "input_text", "text": "s1"}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "id": "msg_x",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    ],
                },
                {"role": "user", "content": []},
                {"role": "user", "content": ""},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                },
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "dev rules"},
                {"role": "system", "content": "s1"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                },
                {"role": "user", "content": ""},
                {"role": "user", "content": ""},
                {"role": "user", "content": "a\nb"},
            ]
        },
        id="roles-images-empty-content",
    ),
    pytest.param(
        {
            "input": [
                {"role": "user", "content": "count lines"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "look first"}],
                    "encrypted_content": seal("look first"),
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "\n\nOn it.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "run_shell",
                    "arguments": '{"cmd": "wc -l f"}',
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "3 f"},
                {"type": "reasoning", "summary": [], "encrypted_content": seal("only sealed")},
                {
                    "type": "custom_tool_call",
                    "call_id": "call_2",
                    "name": "apply_patch",
                    "input": "*** Begin Patch\n*** End Patch",
                },
                {
                    "type": "custom_tool_call_output",
                    "call_id": "call_2",
                    "output": [
                        {"type": "input_text", "text": "Done"},
                        {"type": "input_text", "text": "ok"},
                    ],
                },
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "a summary"}],
                    "encrypted_content": "gAAAA-real-openai-ciphertext",
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "3"}],
                },
                {"role": "user", "content": "thanks"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "run_shell",
                    "parameters": SHELL_SCHEMA,
                    "strict": False,
                },
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "Patch files.",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
                },
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "low", "summary": "auto"},
            "include": ["reasoning.encrypted_content"],
        },
        {
            "messages": [
                {"role": "user", "content": "count lines"},
                {
                    "role": "assistant",
                    "content": "\n\nOn it.",
                    "tool_calls": [call("call_1", "run_shell", '{"cmd": "wc -l f"}')],
                    "reasoning": "look first",
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "3 f"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        call("call_2", "apply_patch", '{"input":"*** Begin Patch\\n*** End Patch"}')
                    ],
                    "reasoning": "only sealed",
                },
                {"role": "tool", "tool_call_id": "call_2", "content": "Done\nok"},
                {"role": "assistant", "content": "3", "reasoning": "a summary"},
                {"role": "user", "content": "thanks"},
            ],
            "tools": [
                fn("run_shell", SHELL_SCHEMA, strict=False),
                fn(
                    "apply_patch",
                    CUSTOM_SCHEMA,
                    "Patch files.\n\nThe input must match this lark grammar:\nstart: /.+/",
                ),
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "low"},
        },
        id="history-items-merge-into-turns",
    ),
    pytest.param(
        {
            "input": [
                {
                    "type": "additional_tools",
                    "role": "developer",
                    "tools": [
                        {
                            "type": "namespace",
                            "name": "functions",
                            "description": "",
                            "tools": [
                                {
                                    "type": "custom",
                                    "name": "exec",
                                    "description": "Run JS.",
                                    "format": {"type": "text"},
                                },
                            ],
                        },
                        {
                            "type": "namespace",
                            "name": "collaboration",
                            "description": "Sub-agents.",
                            "tools": [
                                {"type": "function", "name": "spawn_agent", "parameters": {}}
                            ],
                        },
                    ],
                },
                {"role": "user", "content": "go"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "namespace": "collaboration",
                    "name": "spawn_agent",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "exec", "input": "text(1)"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "1"},
            ],
            "tool_choice": {
                "type": "function",
                "namespace": "collaboration",
                "name": "spawn_agent",
            },
            "reasoning": {"effort": "none"},
        },
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("c1", "collaboration.spawn_agent", "{}")],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "spawned"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("c2", "exec", '{"input":"text(1)"}')],
                },
                {"role": "tool", "tool_call_id": "c2", "content": "1"},
            ],
            "tools": [
                fn("exec", CUSTOM_SCHEMA, "Run JS."),
                fn("collaboration.spawn_agent", {}, "Sub-agents."),
            ],
            "tool_choice": {"type": "function", "function": {"name": "collaboration.spawn_agent"}},
            "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "none"},
        },
        id="codex-namespaces",
    ),
    pytest.param(
        {
            "input": "json please",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "n",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
            "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []},
            "tools": [{"type": "function", "name": "f"}],
        },
        {
            "messages": [{"role": "user", "content": "json please"}],
            "tools": [fn("f")],
            "tool_choice": "required",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
            },
        },
        id="structured-output-and-allowed-tools",
    ),
]


@pytest.mark.parametrize(("body", "chat"), RESPONSES_CASES)
def test_responses_request_golden(body, chat):
    req = parse(RESPONSES, body, "/v1/responses")
    assert req.chat == chat
    assert req.purpose == "main" and not req.local


def test_responses_notes_hosted_tools():
    req = parse(
        RESPONSES,
        {"input": "x", "tools": [{"type": "web_search"}, {"type": "file_search"}]},
        "/v1/responses",
    )
    assert "tools" not in req.chat
    assert req.notes == [
        "hosted tool not offered: web_search",
        "hosted tool not offered: file_search",
    ]


RESPONSES_REFUSALS = [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    (
        {"input": [{"type": "local_shell_call", "call_id": "c"}]},
        "'local_shell_call' is not supported",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input_file",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
        "file_id",
    ),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"input": 5}, "'input' is required"),
    ({"model": "m"}, "'input' is required"),
    ({"input": "x", "tools": [{"type": "computer_use_2099"}]}, "tool type"),
    ({"input": "x", "tools": "all"}, "'tools' must be a list"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "needle"), RESPONSES_REFUSALS)
def test_responses_refusals_name_the_problem(body, needle):
    with pytest.raises(DialectError) as e:
        parse(RESPONSES, body, "/v1/responses")
    assert needle in e.value.message and e.value.status == 400


def test_responses_malformed_body():
    for raw, needle in ((b"{", "not valid JSON"), (b"[]", "JSON object")):
        with pytest.raises(DialectError, match=needle):
            RESPONSES.parse(raw, "/v1/responses")
    body = RESPONSES.error_body(400, "bad", "invalid_request_error")
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    long = "This model's maximum context length is 40960 tokens. However, you requested 50000"
    assert RESPONSES.error_body(400, long, "invalid_request_error")["error"]["code"] == (
        "context_length_exceeded"
    )


def test_codex_recorded_requests():
    """Codex 0.169's real bodies (docs/harness-wire-notes.md): tools only in additional_tools,
    four developer messages, a custom exec call answered by a list of input_text parts."""
    turn1 = parse(RESPONSES, golden("codex_turn1.json")["body"], "/v1/responses")
    turn2 = parse(RESPONSES, golden("codex_turn2.json")["body"], "/v1/responses")
    names = [t["function"]["name"] for t in turn2.chat["tools"]]
    assert names == [
        "exec",
        "wait",
        "request_user_input",
        "request_user_input_async",
        "clock.sleep",
        "collaboration.followup_task",
        "collaboration.interrupt_agent",
        "collaboration.list_agents",
        "collaboration.send_message",
        "collaboration.spawn_agent",
        "collaboration.wait_agent",
    ]
    exec_tool = turn2.chat["tools"][0]["function"]
    assert exec_tool["parameters"] == CUSTOM_SCHEMA
    assert "The input must match this lark grammar:" in exec_tool["description"]
    assert "tools.exec_command" in exec_tool["description"]  # the nested tools' declarations
    sleep = turn2.chat["tools"][4]["function"]
    assert sleep["description"].startswith("Tools for reading and waiting on time.\n\n")
    assert sleep["strict"] is False
    assert [m["role"] for m in turn1.chat["messages"]] == ["system"] * 4 + ["user"] * 2
    assert turn1.chat["messages"][0]["content"].startswith("You are Codex")
    # turn 2 = turn 1 + the model's call + its output
    assert turn2.chat["messages"][:6] == turn1.chat["messages"]
    assistant, tool = turn2.chat["messages"][6:]
    [exec_call] = assistant["tool_calls"]
    assert exec_call["function"]["name"] == "exec"
    assert json.loads(exec_call["function"]["arguments"])["input"].startswith(
        "const r = await tools.exec_command("
    )
    assert tool["content"] == "Script completed\nWall time 0.1 seconds\nOutput:\n\npolar was here"
    assert tool["tool_call_id"] == exec_call["id"]
    assert turn2.chat["parallel_tool_calls"] is False and turn2.chat["tool_choice"] == "auto"
    assert turn2.chat["chat_template_kwargs"] == {
        "enable_thinking": True,
        "reasoning_effort": "low",
    }
    assert turn2.extra["seal"] is True and turn2.stream is True
    assert turn2.extra["tools"]["exec"].kind == "custom"
    assert turn2.extra["tools"]["clock.sleep"].namespace == "clock"


# -- Messages requests: golden table -------------------------------------------------------------

MESSAGES_CASES = [
    pytest.param(
        {
            "model": "claude-x",
            "max_tokens": 100,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.2,
            "top_k": 5,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
            "some_future_field": True,
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 100,
            "temperature": 0.2,
            "top_k": 5,
            "stop": ["END"],
        },
        id="simple",
    ),
    pytest.param(
        {
            "max_tokens": 10,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abcde;"},
                {
                    "type": "text",
                    "text": "You are a Claude agent.",
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "Rules."},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                        {"type": "text", "text": "count", "cache_control": {"type": "ephemeral"}},
                    ],
                },
                {"role": "system", "content": "env: linux", "output_config": {}},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "thinking",
                            "thinking": "use Bash",
                            "signature": "sig-from-anthropic",
                        },
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Running."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "Bash",
                            "input": {"command": "ls"},
                        },
                        {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "a\nb",
                            "is_error": False,
                            "cache_control": {"type": "ephemeral"},
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [
                                {"type": "text", "text": "img:"},
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/jpeg",
                                        "data": "QUJD",
                                    },
                                },
                            ],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "", "signature": seal("sealed thought")},
                        {"type": "text", "text": "Two."},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                        {
                            "type": "document",
                            "source": {
                                "type": "text",
                                "media_type": "text/plain",
                                "data": "doc text",
                            },
                        },
                    ],
                },
            ],
            "tools": [
                {
                    "name": "Bash",
                    "description": "Run",
                    "input_schema": SHELL_SCHEMA,
                    "cache_control": {"type": "ephemeral"},
                },
                {"name": "Read", "input_schema": {"type": "object"}, "strict": True},
                {"name": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "medium"},
            "context_management": {"edits": []},
        },
        {
            "messages": [
                {"role": "system", "content": "You are a Claude agent.\nRules."},
                {"role": "user", "content": "<system-reminder>r</system-reminder>\ncount"},
                {"role": "system", "content": "env: linux"},
                {
                    "role": "assistant",
                    "content": "Running.",
                    "tool_calls": [
                        call("toolu_1", "Bash", '{"command":"ls"}'),
                        call("toolu_2", "Read", "{}"),
                    ],
                    "reasoning": "use Bash",
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "a\nb"},
                {
                    "role": "tool",
                    "tool_call_id": "toolu_2",
                    "content": [
                        {"type": "text", "text": "img:"},
                        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                    ],
                },
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "Two.", "reasoning": "sealed thought"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                        {"type": "text", "text": "doc text"},
                    ],
                },
            ],
            "tools": [fn("Bash", SHELL_SCHEMA, "Run"), fn("Read", {"type": "object"}, strict=True)],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 10,
            "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "medium"},
        },
        id="blocks-tools-thinking",
    ),
    pytest.param(
        {
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "find a tool"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "ToolSearch",
                            "input": {"query": "x"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "tool_reference", "tool_name": "Deferred"}],
                        }
                    ],
                },
                {"role": "assistant", "content": []},
            ],
            "tools": [
                {"name": "ToolSearch", "input_schema": {"type": "object"}},
                {"name": "Deferred", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
            "tool_choice": {"type": "tool", "name": "Deferred"},
            "thinking": {"type": "disabled"},
        },
        {
            "messages": [
                {"role": "user", "content": "find a tool"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("t1", "ToolSearch", '{"query":"x"}')],
                },
                {"role": "tool", "tool_call_id": "t1", "content": "Deferred"},
                {"role": "assistant", "content": ""},
            ],
            "tools": [fn("ToolSearch", {"type": "object"}), fn("Deferred", {"type": "object"})],
            "tool_choice": {"type": "function", "function": {"name": "Deferred"}},
            "max_tokens": 5,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        id="tool-search-loads-deferred-tool",
    ),
    pytest.param(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"k": [1, "é"]}},
                        {"type": "text", "text": "b"},
                    ],
                },
                {"role": "assistant", "content": "second turn"},
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "a\nb",
                    "tool_calls": [call("t1", "f", '{"k":[1,"é"]}')],
                },
                {"role": "assistant", "content": "second turn"},
            ],
        },
        id="texts-of-one-turn-joined-turns-kept-apart",
    ),
]


@pytest.mark.parametrize(("body", "chat"), MESSAGES_CASES)
def test_messages_request_golden(body, chat):
    req = parse(MESSAGES, body, "/v1/messages")
    assert req.chat == chat
    assert not req.local


def test_messages_notes_and_thinking_display():
    req = parse(MESSAGES, MESSAGES_CASES[1].values[0], "/v1/messages")
    assert req.notes == [
        "dropped system[0]: x-anthropic-billing-header: block",
        "skipped messages[2].content[1]: redacted_thinking",
        "deferred tool not offered: Deferred",
    ]
    assert req.extra["show_thinking"] is False


MESSAGES_REFUSALS = [
    ({"messages": []}, "must not be empty"),
    ({"messages": "hi"}, "'messages'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "'search_result'"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {
                                "type": "base64",
                                "media_type": "application/pdf",
                                "data": "x",
                            },
                        }
                    ],
                }
            ]
        },
        "plain-text documents",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}
            ]
        },
        "base64 or url",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
        "'server_tool_use'",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        "server tool",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}},
        "thinking",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "'system'"),
]


@pytest.mark.parametrize(("body", "needle"), MESSAGES_REFUSALS)
def test_messages_refusals_name_the_problem(body, needle):
    with pytest.raises(DialectError) as e:
        parse(MESSAGES, body, "/v1/messages")
    assert needle in e.value.message and e.value.status == 400


def test_messages_error_shape():
    assert MESSAGES.error_body(400, "bad", "invalid_request_error") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    assert (
        MESSAGES.error_body(429, "slow", "rate_limit_error")["error"]["type"] == "rate_limit_error"
    )
    assert MESSAGES.error_body(502, "down", "server_error")["error"]["type"] == "api_error"
    assert MESSAGES.error_body(404, "no", "x")["error"]["type"] == "not_found_error"


def test_claude_code_recorded_requests():
    """Claude Code 2.1.328's real bodies: the billing block is dropped (it changes every call),
    the system message inside `messages` is kept, deferred tools are not offered."""
    t1 = golden("claude_turn1.json")["body"]
    t2 = golden("claude_turn2.json")["body"]
    assert t1["system"][0]["text"] != t2["system"][0]["text"]  # the per-call billing block
    r1 = parse(MESSAGES, t1, "/v1/messages")
    r2 = parse(MESSAGES, t2, "/v1/messages")
    assert r1.chat["messages"][0] == r2.chat["messages"][0]  # so the prompts share a prefix
    assert "x-anthropic-billing-header" not in json.dumps(r2.chat)
    assert r2.notes[0] == "dropped system[0]: x-anthropic-billing-header: block"
    assert "deferred tool not offered: DeferredToolPlaceholder" in r2.notes
    roles = [m["role"] for m in r2.chat["messages"]]
    assert roles == ["system", "user", "system", "assistant", "tool"]
    assert r2.chat["messages"][:3] == r1.chat["messages"]
    [bash] = r2.chat["messages"][3]["tool_calls"]
    assert bash["function"]["name"] == "Bash" and "command" in json.loads(
        bash["function"]["arguments"]
    )
    assert r2.chat["messages"][4] == {
        "role": "tool",
        "tool_call_id": bash["id"],
        "content": "polar was here",
    }
    names = [t["function"]["name"] for t in r2.chat["tools"]]
    assert "Bash" in names and "DeferredToolPlaceholder" not in names and len(names) == 11
    assert r2.chat["tools"][names.index("Bash")]["function"]["parameters"]["$schema"]
    assert r2.chat["max_tokens"] == 128000
    assert r2.chat["chat_template_kwargs"] == {
        "enable_thinking": True,
        "reasoning_effort": "medium",
    }
    assert r2.purpose == "main" and r2.stream is True and r2.extra["show_thinking"] is False


@pytest.mark.parametrize(
    ("system", "tools", "purpose"),
    [
        ("You are Claude Code. Write a 3-7 word title for this conversation.", None, "title"),
        ("You are Claude Code. Summarize the conversation so far.", None, "summary"),
        ("You are Claude Code. Is this a new topic?", None, "side"),
        ("You are Claude Code.", [{"name": "Bash", "input_schema": {"type": "object"}}], "main"),
        ("You are a helpful assistant. Write a title.", None, "main"),  # not Claude Code
    ],
)
def test_messages_purpose(system, tools, purpose):
    body = {"max_tokens": 5, "system": system, "messages": [{"role": "user", "content": "x"}]}
    if tools:
        body["tools"] = tools
    assert parse(MESSAGES, body, "/v1/messages").purpose == purpose


def test_count_tokens_is_local():
    body = {
        "model": "claude",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "Bash", "input_schema": SHELL_SCHEMA}],
    }
    req = parse(MESSAGES, body, "/v1/messages/count_tokens")
    assert req.local and req.purpose == "count_tokens" and not req.stream

    class Counter:
        def prompt_tokens(self, chat):
            assert chat == req.chat
            return 42

    assert MESSAGES.local_reply(req, Counter()) == {"input_tokens": 42}


# -- replies: chat chunks as vLLM streams them ---------------------------------------------------


def chunk(delta: dict | None = None, finish: str | None = None, **extra: Any) -> dict:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish, **extra}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "Qwen",
        "choices": [choice],
    }


USAGE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "Qwen",
    "choices": [],
    "usage": {
        "prompt_tokens": 11,
        "completion_tokens": 7,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


def tool_delta(
    index: int, *, id: str | None = None, name: str | None = None, args: str = ""
) -> dict:
    tc: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id:
        tc.update(id=id, type="function")
        tc["function"]["name"] = name
    return chunk({"tool_calls": [tc]})


EXEC_JS = 'const r = await tools.exec_command({cmd: "ls"});\ntext("é ✓ 𝄞 \\\\ done");'


def full_turn() -> list[dict]:
    """Reasoning, the separator vLLM leaves as content, text, a function call and a custom call."""
    args = json.dumps({"input": EXEC_JS})
    return [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Let me"}),
        chunk({"reasoning": " think."}),
        chunk({"content": "\n\n"}),
        chunk({"content": "Hi "}),
        chunk({"content": "there"}),
        tool_delta(0, id="chatcmpl-tool-a", name="run_shell"),
        tool_delta(0, args='{"cmd": "ls'),
        tool_delta(0, args=' -la"}'),
        tool_delta(1, id="chatcmpl-tool-b", name="exec", args=args[:9]),
        *[tool_delta(1, args=args[i : i + 5]) for i in range(9, len(args), 5)],
        chunk({}, "tool_calls"),
        USAGE,
    ]


def codex_like_request(stream: bool = True):
    body = {
        "model": "gpt-5",
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "input": [
            {
                "type": "additional_tools",
                "role": "developer",
                "tools": [
                    {
                        "type": "namespace",
                        "name": "functions",
                        "tools": [{"type": "custom", "name": "exec", "description": "JS"}],
                    }
                ],
            },
            {"role": "user", "content": "hi"},
        ],
        "tools": [{"type": "function", "name": "run_shell", "parameters": SHELL_SCHEMA}],
    }
    return parse(RESPONSES, body, "/v1/responses")


def sse_bytes(translator, chunks: list[dict], end: str = "finish") -> bytes:
    data = b"".join(translator.chunk(c) for c in chunks)
    return data + (translator.finish() if end == "finish" else translator.fail("upstream died"))


def openai_oracle(data: bytes):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = openai.OpenAI(
        api_key="x", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )
    return client.responses.stream(model="m", input="x")


def anthropic_oracle(data: bytes):
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=data)

    client = anthropic.Anthropic(
        api_key="x",
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(transport=httpx2.MockTransport(handler)),
    )
    return client.messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    )


def test_responses_stream_accepted_by_the_sdk():
    req = codex_like_request()
    translator = RESPONSES.stream(req)
    translator.prompt_tokens = 11
    data = sse_bytes(translator, full_turn())
    with openai_oracle(data) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert (
        types[:2] == ["response.created", "response.in_progress"]
        and types[-1] == "response.completed"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        "response.reasoning_text.delta" in types
        and "response.custom_tool_call_input.delta" in types
    )
    reasoning, message, fcall, ccall = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert unseal(reasoning.encrypted_content) == "Let me think."
    assert message.type == "message" and message.content[0].text == "\n\nHi there"
    assert (fcall.type, fcall.name, fcall.call_id) == (
        "function_call",
        "run_shell",
        "chatcmpl-tool-a",
    )
    assert json.loads(fcall.arguments) == {"cmd": "ls -la"}
    assert (ccall.type, ccall.name, ccall.input) == ("custom_tool_call", "exec", EXEC_JS)
    assert ccall.namespace is None  # Codex's default namespace: bare names, as it sends them back
    streamed = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert streamed == EXEC_JS
    u = final.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (11, 7, 18)
    assert (
        u.input_tokens_details.cached_tokens == 4 and u.output_tokens_details.reasoning_tokens == 0
    )
    assert final.status == "completed" and final.id == events[0].response.id
    # the same reply, non-streaming and synthesized from a whole completion, is the same object
    whole = {
        "id": "c",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "\n\nHi there",
                    "reasoning": "Let me think.",
                    "tool_calls": [
                        call("chatcmpl-tool-a", "run_shell", '{"cmd": "ls -la"}'),
                        call("chatcmpl-tool-b", "exec", json.dumps({"input": EXEC_JS})),
                    ],
                },
            }
        ],
        "usage": USAGE["usage"],
    }
    reply = RESPONSES.reply(codex_like_request(stream=False), json.loads(json.dumps(whole)))
    synthesized = RESPONSES.stream(req)
    sse_bytes(synthesized, reply_to_chunks(whole))
    for obj in (reply, synthesized.final()):
        got = [
            (i["type"], i.get("name"), i.get("arguments") or i.get("input")) for i in obj["output"]
        ]
        want = [
            (
                i.type,
                getattr(i, "name", None),
                getattr(i, "arguments", None) or getattr(i, "input", None),
            )
            for i in final.output
        ]
        assert got == want
        assert obj["usage"] == final.usage.model_dump(exclude_none=True)


def test_responses_length_and_failure():
    req = codex_like_request()
    t = RESPONSES.stream(req)
    data = sse_bytes(t, [chunk({"content": "cut"}), chunk({}, "length")])
    with openai_oracle(data) as stream:
        events = [e for e in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    t = RESPONSES.stream(req)
    data = sse_bytes(t, [chunk({"content": "half"})], end="fail")
    with openai_oracle(data) as stream:
        events = [e for e in stream]
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()
    assert events[-1].type == "response.failed"
    assert events[-1].response.id == events[0].response.id
    assert events[-1].response.error.message == "upstream died"
    # failing before the first chunk still starts the response the SDK expects first
    data = RESPONSES.stream(req).fail("refused")
    with openai_oracle(data) as stream:
        assert [e.type for e in stream][-1] == "response.failed"


def test_whitespace_before_a_tool_call_is_the_templates():
    """vLLM's parser returns the separator before <tool_call> as content; the harness must not
    get it (sent back, Qwen3 would render it twice), while trailing text at the end stays."""
    req = codex_like_request()
    t = RESPONSES.stream(req)
    sse_bytes(
        t,
        [
            chunk({"reasoning": "r"}),
            chunk({"content": "\n\n"}),
            tool_delta(0, id="x", name="run_shell", args="{}"),
            chunk({}, "tool_calls"),
        ],
    )
    assert [i["type"] for i in t.final()["output"]] == ["reasoning", "function_call"]
    t = RESPONSES.stream(req)
    sse_bytes(
        t,
        [
            chunk({"content": "\n\nCounting"}),
            chunk({"content": " now.\n"}),
            tool_delta(0, id="x", name="run_shell", args="{}"),
            chunk({}, "tool_calls"),
        ],
    )
    assert t.final()["output"][0]["content"][0]["text"] == "\n\nCounting now."
    msg = parse(MESSAGES, {"messages": [{"role": "user", "content": "x"}]}, "/v1/messages")
    t = MESSAGES.stream(msg)
    data = sse_bytes(
        t,
        [
            chunk({"content": " "}),
            chunk({"content": "\n"}),
            chunk({"content": "ok \n"}),
            chunk({"content": "then"}),
            chunk({"content": "\n"}),
            chunk({}, "stop"),
        ],
    )
    assert t.final()["content"] == [{"type": "text", "text": " \nok \nthen\n"}]
    with anthropic_oracle(data) as stream:
        assert stream.get_final_message().content[0].text == " \nok \nthen\n"


def test_responses_logprobs_when_asked():
    req = parse(
        RESPONSES,
        {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 1},
        "/v1/responses",
    )
    assert req.wants_logprobs and req.top_logprobs == 1
    lp = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
            }
        ]
    }
    data = sse_bytes(
        RESPONSES.stream(req), [chunk({"content": "Hi"}, logprobs=lp), chunk({}, "stop")]
    )
    with openai_oracle(data) as stream:
        final = stream.get_final_response()
    [entry] = final.output[0].content[0].logprobs
    assert (entry.token, entry.logprob) == ("Hi", -0.5)


def messages_request(**extra: Any):
    body = {
        "model": "claude-x",
        "max_tokens": 50,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }
    return parse(MESSAGES, body, "/v1/messages")


def test_messages_stream_accepted_by_the_sdk():
    req = messages_request(stop_sequences=["END"])
    t = MESSAGES.stream(req)
    t.prompt_tokens = 11
    data = sse_bytes(t, full_turn())
    with anthropic_oracle(data) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    thinking, text, bash, exec_call = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think."
    assert unseal(thinking.signature) == "Let me think."
    assert text.text == "\n\nHi there"
    assert (bash.type, bash.name, bash.id, bash.input) == (
        "tool_use",
        "run_shell",
        "chatcmpl-tool-a",
        {"cmd": "ls -la"},
    )
    assert exec_call.input == {"input": EXEC_JS}
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    u = final.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (7, 4, 7)
    # non-streaming: the same message
    whole = {
        "id": "c",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": "END",
                "message": {"role": "assistant", "content": "done"},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    reply = MESSAGES.reply(req, whole)
    assert reply["content"] == [{"type": "text", "text": "done"}]
    assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", "END")
    assert anthropic.types.Message.model_validate(reply).usage.output_tokens == 2


@pytest.mark.parametrize(
    ("finish", "reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
    ],
)
def test_messages_stop_reasons(finish, reason):
    t = MESSAGES.stream(messages_request())
    data = sse_bytes(t, [chunk({"content": "x"}), chunk({}, finish)])
    with anthropic_oracle(data) as stream:
        assert stream.get_final_message().stop_reason == reason


def test_messages_thinking_omitted_and_failure():
    req = messages_request(thinking={"type": "adaptive", "display": "omitted"})
    t = MESSAGES.stream(req)
    data = sse_bytes(
        t, [chunk({"reasoning": "secret plan"}), chunk({"content": "ok"}), chunk({}, "stop")]
    )
    with anthropic_oracle(data) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == "" and unseal(final.content[0].signature) == "secret plan"
    assert b"secret plan" not in data  # only inside the sealed signature
    # the block comes back next turn without text: the reasoning still reaches the template
    history = {
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [c.model_dump(exclude_none=True) for c in final.content],
            },
            {"role": "user", "content": "more"},
        ],
    }
    assert (
        parse(MESSAGES, history, "/v1/messages").chat["messages"][1]["reasoning"] == "secret plan"
    )
    t = MESSAGES.stream(req)
    data = sse_bytes(t, [chunk({"content": "half"})], end="fail")
    with (
        anthropic_oracle(data) as stream,
        pytest.raises(anthropic.APIStatusError, match="upstream died"),
    ):
        for _ in stream:
            pass


def test_streaming_emits_each_chunk_at_once():
    """Nothing is held back: every text chunk produces its delta event right away."""
    for dialect, req in ((RESPONSES, codex_like_request()), (MESSAGES, messages_request())):
        t = dialect.stream(req)
        assert t.chunk(chunk({"role": "assistant", "content": ""}))  # the stream has started
        for word in ("one", " two", " three"):
            assert word.encode() in t.chunk(chunk({"content": word}))


# -- custom tool input, decoded while it streams -------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
    ascii_only=st.booleans(),
    spaced=st.booleans(),
)
def test_input_decoder_any_cuts(text, cuts, ascii_only, spaced):
    args = json.dumps({"input": text}, ensure_ascii=ascii_only)
    if spaced:
        args = args.replace('{"input": ', '{ "input" :  ', 1)
    points = sorted({c % (len(args) + 1) for c in cuts} | {0, len(args)})
    decoder = _InputDecoder()
    out = "".join(decoder.feed(args[a:b]) for a, b in zip(points, points[1:], strict=False))
    assert out == text
    assert custom_input(args) == text


def test_custom_input_other_shapes():
    assert custom_input("raw text the policy wrote") == "raw text the policy wrote"
    assert custom_input('{"code": "x"}') == "x"
    assert custom_input('"just a string"') == "just a string"
    assert custom_input('{"a": 1, "b": 2}') == '{"a": 1, "b": 2}'
    decoder = _InputDecoder()
    assert decoder.feed('{"code": "x"}') == ""  # not the one-argument form: left to the end


# -- the output-cap clamp and local token counts --------------------------------------------------


@pytest.mark.parametrize(
    ("message", "cap_refused"),
    [
        # vLLM 0.33 (vllm/renderers/params.py): a cap above the whole context
        (
            "max_tokens=128000 cannot be greater than max_model_len=32768. Please request fewer "
            "output tokens. (parameter=max_tokens, value=128000)",
            True,
        ),
        (
            "max_completion_tokens=200000 cannot be greater than max_model_len=131072. Please "
            "request fewer output tokens. (parameter=max_completion_tokens, value=200000)",
            True,
        ),
        # vLLM 0.33: a prompt too long by itself (it once matched "output tokens ... maximum")
        (
            "This model's maximum context length is 32768 tokens. However, your prompt contains "
            "40000 input tokens, which exceeds this limit even without any output tokens. Please "
            "reduce the length of the input prompt. (parameter=input_tokens, value=40000)",
            False,
        ),
        (
            "This model's maximum context length is 32768 tokens. However, your prompt contains "
            "at least 32769 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            False,
        ),
        # SGLang: a prompt too long by itself
        ("The input (5000 tokens) is longer than the model's context length (4096 tokens).", False),
        # vLLM 0.10 (the reference server's --vllm-limits 0.10)
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 128000. This model's maximum "
            "context length is 131072 tokens and your request has 11435 input tokens "
            "(128000 > 131072 - 11435). (parameter=max_tokens, value=128000)",
            True,
        ),
        # vLLM 0.20 (issue vllm-project/vllm#42474) and older vLLM
        (
            "This model's maximum context length is 128000 tokens. However, you requested 65535 "
            "output tokens and your prompt contains at least 62466 input tokens, for a total of at "
            "least 128001 tokens.",
            True,
        ),
        (
            "This model's maximum context length is 16384 tokens. However, you requested 122946 "
            "tokens (112946 in the messages, 10000 in the completion).",
            True,
        ),
        # SGLang
        (
            "Requested token count exceeds the model's maximum context length of 4096 tokens. You "
            "requested a total of 5000 tokens: 1000 tokens from the input messages and 4000 tokens "
            "for the completion.",
            True,
        ),
        # a prompt that is too long by itself: no retry helps
        (
            "This model's maximum context length is 40960 tokens. However, your request has 50000 "
            "input tokens. Please reduce the length of the input messages. "
            "(parameter=input_tokens, value=50000)",
            False,
        ),
        ("messages[1].content must be a string", False),
    ],
)
def test_output_cap_refusal_is_recognized(message, cap_refused):
    from polar_mitm.call.failures import cap_refused as refused

    assert refused(message) is cap_refused


def test_prompt_counter():
    from transformers import AutoTokenizer

    from polar_mitm.assets import qwen3_tokenizer_dir
    from polar_mitm.tokens.count import PromptCounter
    from polar_mitm.tokens.tokenizer import load_tokenizer

    chat = parse(MESSAGES, MESSAGES_CASES[1].values[0], "/v1/messages/count_tokens").chat
    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    exact = PromptCounter(load_tokenizer(str(qwen3_tokenizer_dir()))).prompt_tokens(chat)
    messages = []
    for m in chat["messages"]:  # vLLM's view, images left out (a text-only template)
        m = dict(m)
        if isinstance(m["content"], list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p["type"] == "text")
        for c in m.get("tool_calls") or ():
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
        messages.append(m)
    # vLLM dumps each tool with every field, a missing description as null
    tools = [
        {"type": "function", "function": {"description": None, **t["function"]}}
        for t in chat["tools"]
    ]
    want = tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        enable_thinking=True,
        reasoning_effort="medium",
    )
    assert exact == len(want["input_ids"])
    estimate = PromptCounter(None).prompt_tokens(chat)
    assert estimate > 0 and abs(estimate - exact) < exact  # the right order of magnitude
