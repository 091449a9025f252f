"""Per-kind truths for end-to-end tests: what each policy-server kind itself says about a request.

Dialect tests run against every kind of the reference server (`conftest.UPSTREAM_KINDS`) and
compare the proxy's records with these. `direct_ids` asks the server directly (no proxy) with that
kind's own token flags; `expected_prompt_ids` renders the Qwen3 template after normalizing the
messages the way that kind does — written here independently of `polar_mitm.tokens.conversation`, so a
bug there cannot hide in both the server and the test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MODEL = "Qwen/Qwen3-4B"


@dataclass(frozen=True)
class Truth:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    reply: dict[str, Any]


def direct_ids(
    server_url: str, kind: str, messages: list[dict], tools: list[dict] | None = None, **extra: Any
) -> Truth:
    """The ids and logprobs the server itself returns for this request (non-streaming)."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "logprobs": True, **extra}
    if tools:
        body["tools"] = tools
    if kind == "sglang":
        body.update(return_prompt_token_ids=True, return_meta_info=True)
    else:
        body.update(return_token_ids=True, top_logprobs=0)
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    reply = r.json()
    choice = reply["choices"][0]
    if kind == "sglang":
        triples = choice["meta_info"]["output_token_logprobs"]
        return Truth(
            choice["prompt_token_ids"], [t[1] for t in triples], [t[0] for t in triples], reply
        )
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    return Truth(reply["prompt_token_ids"], choice["token_ids"], lps, reply)


def _parsed_args(message: dict) -> dict:
    m = dict(message)
    if m.get("tool_calls"):
        m["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in m["tool_calls"]
        ]
    return m


def vllm_conversation(messages: list[dict]) -> list[dict]:
    """What vLLM renders: tool-call arguments parsed to objects, null content as ''."""
    out = []
    for m in messages:
        m = _parsed_args(m)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def sglang_conversation(messages: list[dict]) -> list[dict]:
    """What SGLang renders: null content as '', None-valued keys dropped, tool-call arguments
    parsed, an assistant's `reasoning` carried only as `reasoning_content`."""
    out = []
    for m in messages:
        m = _parsed_args(m)
        if "reasoning" in m:
            m.setdefault("reasoning_content", m.pop("reasoning"))
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list):
            m["content"] = " ".join(p["text"] for p in m["content"] if p.get("type") == "text")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def sglang_tools(tools: list[dict]) -> list[dict]:
    """`Tool.model_dump()`: strict defaults to false, defer_loading is dumped as null."""
    return [
        {
            "type": t.get("type", "function"),
            "function": {
                "description": t["function"].get("description"),
                "name": t["function"]["name"],
                "parameters": t["function"].get("parameters"),
                "strict": bool(t["function"].get("strict", False)),
            },
            "defer_loading": None,
        }
        for t in tools
    ]


def expected_prompt_ids(
    tokenizer: Any, kind: str, messages: list[dict], tools: list[dict] | None = None
) -> list[int]:
    """The Qwen3 prompt ids this kind of server computes for the messages (tool_choice auto)."""
    if kind == "sglang":
        conv, rendered_tools = sglang_conversation(messages), sglang_tools(tools) if tools else None
    else:
        conv, rendered_tools = vllm_conversation(messages), tools
    return tokenizer.apply_chat_template(
        conv, tools=rendered_tools, add_generation_prompt=True, tokenize=True
    )["input_ids"]


def aborting_scenario(source: Path, tmp: Path) -> Path:
    """`source` with every turn ending in SGLang's `abort` finish (the reference server's knob)."""
    scenario = json.loads(source.read_text())
    for script in scenario["scripts"]:
        for turn in script["turns"]:
            turn["finish_reason"] = "abort"
    path = tmp / "abort.json"
    path.write_text(json.dumps(scenario))
    return path
