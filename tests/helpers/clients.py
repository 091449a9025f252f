"""Clients that go through the proxy the way harnesses do: HTTPS_PROXY + the generated CA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai

from .procs import Mitm

RUN_SHELL = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "the command"}},
            "required": ["cmd"],
        },
    },
}
TOOL_OUTPUTS = {"cat notes.txt": "alpha\nbeta\ngamma\n", "wc -l notes.txt": "3 notes.txt"}


def http_client(
    mitm: Mitm, user: str | None = None, password: str = "pw", **kw: Any
) -> httpx.Client:
    return httpx.Client(proxy=mitm.proxy(user, password), verify=str(mitm.ca), timeout=60, **kw)


def openai_client(
    mitm: Mitm,
    api_key: str = "polar-test.0",
    user: str | None = None,
    password: str = "pw",
    **headers: str,
) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="https://api.openai.com/v1",
        api_key=api_key,
        http_client=http_client(mitm, user, password),
        default_headers=headers or None,
        max_retries=0,
    )


def run_tool_conversation(
    client: openai.OpenAI, stream: bool, model: str = "gpt-4.1-mini", turns: int = 3
) -> tuple[list[list[dict]], list[dict]]:
    """Drive the scripted tool loop; returns the messages sent on each call and each reply."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "How many lines does notes.txt have?"},
    ]
    sent, replies = [], []
    for _ in range(turns):
        sent.append(json.loads(json.dumps(messages)))
        if stream:
            reply = _streamed_reply(client, messages, model)
        else:
            completion = client.chat.completions.create(
                model=model, messages=messages, tools=[RUN_SHELL]
            )
            assert completion.model == model
            assert "prompt_token_ids" not in (completion.model_extra or {})
            choice = completion.choices[0]
            assert "token_ids" not in (choice.model_extra or {})
            assert choice.logprobs is None
            reply = choice.message.model_dump(exclude_none=True)
            reply["finish_reason"] = choice.finish_reason
        replies.append(reply)
        assistant = {"role": "assistant", "content": reply.get("content")}
        if reply.get("tool_calls"):
            assistant["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]}
                for c in reply["tool_calls"]
            ]
        messages.append(assistant)
        messages += tool_messages(reply)
        if not reply.get("tool_calls"):
            break
    return sent, replies


# -- a tool loop's next turn, per dialect: what a harness sends back after a reply ---------------


def tool_messages(reply: dict) -> list[dict]:
    """Chat completions: the `tool` messages answering a reply's run_shell calls."""
    return [
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": TOOL_OUTPUTS[json.loads(call["function"]["arguments"])["cmd"]],
        }
        for call in reply.get("tool_calls") or ()
    ]


def responses_next(final: Any) -> tuple[list[dict], bool]:
    """Responses: the items to append after a reply (its output as Codex keeps it, then a
    `function_call_output` per call) and whether it called a tool."""
    items = [item.model_dump(exclude_none=True) for item in final.output]
    calls = [i for i in final.output if i.type == "function_call"]
    for c in calls:
        cmd = json.loads(c.arguments)["cmd"]
        items.append(
            {"type": "function_call_output", "call_id": c.call_id, "output": TOOL_OUTPUTS[cmd]}
        )
    return items, bool(calls)


def messages_next(final: Any, output: Any = None) -> tuple[list[dict], bool]:
    """Anthropic Messages: the assistant turn (its blocks as they came) and a user turn with a
    `tool_result` per `tool_use` (`output(use)`, default the run_shell output), and whether it
    used a tool."""
    turn = [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]}
    ]
    uses = [b for b in final.content if b.type == "tool_use"]
    if uses:
        result = output or (lambda u: TOOL_OUTPUTS[u.input["cmd"]])
        turn.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": result(u)} for u in uses
                ],
            }
        )
    return turn, bool(uses)


def _streamed_reply(client: openai.OpenAI, messages: list[dict], model: str) -> dict:
    content, reasoning, calls, finish = [], [], {}, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[RUN_SHELL], stream=True
    )
    for chunk in stream:
        assert chunk.model == model
        assert "prompt_token_ids" not in (chunk.model_extra or {})
        assert chunk.usage is None, "usage chunk leaked to a harness that did not ask"
        for choice in chunk.choices:
            assert "token_ids" not in (choice.model_extra or {})
            assert choice.logprobs is None
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            extra = delta.model_extra or {}
            if extra.get("reasoning"):
                reasoning.append(extra["reasoning"])
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(
                    tc.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["function"]["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["function"]["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    reply: dict = {
        "role": "assistant",
        "content": "".join(content) or None,
        "finish_reason": finish,
    }
    if reasoning:
        reply["reasoning"] = "".join(reasoning)
    if calls:
        reply["tool_calls"] = [calls[i] for i in sorted(calls)]
    return reply


def vllm_messages(messages: list[dict]) -> list[dict]:
    """What vLLM renders: tool-call arguments parsed to objects, null content as ''."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def grep_bytes(root: Path, needles: list[str]) -> dict[str, list[str]]:
    """Which files under root contain which needle: raw bytes of every file, and the decoded
    values of Parquet files (their pages are zstd-compressed, so raw bytes would hide a secret);
    a Parquet file that does not open (the CLI tests corrupt one on purpose) is read as raw bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found: dict[str, list[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".parquet":
                try:
                    table = pq.read_table(path)
                except pa.ArrowInvalid:  # a shard some test corrupted on purpose: its raw bytes
                    table = None
                if table is not None:
                    data += json.dumps(table.to_pylist(), default=str).encode()
                    data += b"".join(k + v for k, v in (table.schema.metadata or {}).items())
            for needle in needles:
                if needle.encode() in data:
                    found.setdefault(needle, []).append(str(path))
    return found


def completion_ids(choice: dict) -> list[int]:
    """The sampled ids of a /v1/completions choice: its `token_ids` when the request asked
    `return_token_ids`, else the `token_id:N` names of its logprobs (what exact-prefix mode asks:
    `return_tokens_as_token_ids`, so the server does not echo the prompt's ids)."""
    if choice.get("token_ids") is not None:
        return choice["token_ids"]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
