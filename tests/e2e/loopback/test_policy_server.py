"""The reference policy server, tested as a real subprocess over HTTP (httpx and the openai SDK).

The expected values come from the tokenizer and chat template directly, or are written out by hand,
never from the server's own modules, so these tests fail when the wire or the token ids drift.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.helpers import ROOT

SCENARIOS = ROOT / "reference" / "polar_reference" / "scenarios"
MODEL = "Qwen/Qwen3-4B"
IM_END = 151645

RUN_SHELL = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    },
}
SYSTEM = "You are a careful coding agent working in a sandbox."


# -- fixtures -------------------------------------------------------------------------------


class Server:
    """A `python -m polar_reference` child process."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = tmp / f"policy-{os.getpid()}-{time.monotonic_ns()}.log"
        self._err = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "polar_reference", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self._err,
            cwd=ROOT,
        )
        self.url = self._wait_for_url()

    def _wait_for_url(self, timeout: float = 60.0) -> str:
        assert self.popen.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if sel.select(0.5):
                    line = self.popen.stdout.readline().decode()
                    if line.startswith("policy-server listening on "):
                        return line.split(" on ", 1)[1].strip()
                    if not line and self.popen.poll() is not None:
                        break
        finally:
            sel.close()
        self.stop()
        raise RuntimeError(f"policy server did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._err.close()


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("policy-server")


@pytest.fixture(scope="module")
def server(tmp_module: Path) -> Iterator[Server]:
    s = Server(tmp_module, "--scenario", str(SCENARIOS / "tool_loop.json"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def demo(tmp_module: Path) -> Iterator[Server]:
    """The demo scenario, three tokens per chunk at 400 tokens/s, the pre-0.11 reasoning field name."""
    s = Server(
        tmp_module,
        "--chunk-tokens",
        "3",
        "--token-rate",
        "400",
        "--reasoning-field",
        "reasoning_content",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


# -- helpers --------------------------------------------------------------------------------


def template_ids(tokenizer, messages, tools=None, **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
        )["input_ids"]
    )


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, `[DONE]` kept as the string."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def request(messages, *, stream: bool, tools=(RUN_SHELL,), **extra) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "return_token_ids": True,
        "logprobs": True,
    }
    if tools:
        body["tools"] = list(tools)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def assemble(events: list[Any]) -> dict[str, Any]:
    """Fold stream chunks the way a client does."""
    out: dict[str, Any] = {
        "reasoning": "",
        "content": "",
        "ids": [],
        "logprobs": [],
        "tools": {},
        "finish": None,
    }
    for event in events[1:]:
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
        out["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            slot = out["tools"].setdefault(call["index"], {"name": "", "arguments": "", "id": None})
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        out["ids"] += choice["token_ids"]
        if choice["logprobs"] is not None:
            out["logprobs"] += choice["logprobs"]["content"]
        if choice["finish_reason"] is not None:
            out["finish"] = choice["finish_reason"]
    return out


def conversation_at(turn: int) -> list[dict[str, Any]]:
    """The tool_loop conversation after `turn` assistant turns, in the shapes harnesses send."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look around,"},
                {"type": "text", "text": "then report."},
            ],
        },
    ]
    scripted = [
        ("ls -la", "First, list the directory."),
        ("cat notes.txt", None),
        ("wc -l notes.txt", "..."),
    ]
    for i in range(turn):
        cmd, reasoning = scripted[i]
        call_id = f"call_{i}"
        assistant: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": json.dumps({"cmd": cmd})},
                }
            ],
        }
        if reasoning:
            assistant["reasoning_content"] = reasoning
        messages.append(assistant)
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": [{"type": "text", "text": f"output of {cmd}"}],
            }
        )
    return messages


# -- prompt rendering -----------------------------------------------------------------------


def test_prompt_ids_equal_the_chat_template_after_vllm_normalization(
    http: httpx.Client, tokenizer
) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "How long is notes.txt?"},
                {"type": "text", "text": "Be brief."},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning": "Count the lines.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": '{"cmd": "wc -l notes.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3 notes.txt"},
    ]
    # What vLLM hands the template: parts joined with "\n", null content -> "", arguments parsed,
    # reasoning under the template's name.
    normalized = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How long is notes.txt?\nBe brief."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Count the lines.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": {"cmd": "wc -l notes.txt"}},
                }
            ],
        },
        {"role": "tool", "content": "3 notes.txt"},
    ]
    expected = template_ids(tokenizer, normalized, [RUN_SHELL])
    assert "Count the lines." in tokenizer.decode(expected)  # the reasoning reached the template

    full = http.post("/v1/chat/completions", json=request(messages, stream=False)).json()
    assert full["prompt_token_ids"] == expected
    assert full["usage"]["prompt_tokens"] == len(expected)

    stream = sse_events(http.post("/v1/chat/completions", json=request(messages, stream=True)).text)
    assert stream[0]["prompt_token_ids"] == expected
    assert all("prompt_token_ids" not in e for e in stream[1:] if e != "[DONE]")

    tok = http.post(
        "/tokenize", json={"model": MODEL, "messages": messages, "tools": [RUN_SHELL]}
    ).json()
    assert tok["tokens"] == expected and tok["count"] == len(expected)
    assert tok["token_strs"] is None and tok["max_model_len"] > len(expected)


def test_tool_without_description_renders_null_like_pydantic(http: httpx.Client, tokenizer) -> None:
    bare = {"type": "function", "function": {"name": "run_shell", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    expected = template_ids(
        tokenizer,
        messages,
        [
            {
                "type": "function",
                "function": {
                    "name": "run_shell",
                    "description": None,
                    "parameters": {"type": "object"},
                },
            }
        ],
    )
    assert '"description": null' in tokenizer.decode(expected)
    got = http.post("/tokenize", json={"messages": messages, "tools": [bare]}).json()
    assert got["tokens"] == expected


# -- generation: streaming vs not -----------------------------------------------------------


@pytest.mark.parametrize("turn", [0, 1, 2, 3])
def test_streaming_and_non_streaming_agree(http: httpx.Client, tokenizer, turn: int) -> None:
    messages = conversation_at(turn)
    full = http.post("/v1/chat/completions", json=request(messages, stream=False)).json()
    response = http.post("/v1/chat/completions", json=request(messages, stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    streamed = assemble(events)
    choice = full["choices"][0]
    message = choice["message"]

    # Token ids: every sampled token is in exactly one chunk, and the usage counts them.
    ids = choice["token_ids"]
    assert streamed["ids"] == ids
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(ids)
    assert full["usage"]["completion_tokens"] == len(ids)
    assert ids[-1] == IM_END and IM_END not in ids[:-1]

    # One logprob per token, aligned, deterministic, in [-4, 0).
    lps = choice["logprobs"]["content"]
    assert len(lps) == len(ids) == len(streamed["logprobs"])
    assert [e["logprob"] for e in lps] == [e["logprob"] for e in streamed["logprobs"]]
    assert all(-4.0 <= e["logprob"] < 0.0 and e["top_logprobs"] == [] for e in lps)
    assert [e["token"] for e in lps] == [tokenizer.decode([i]) for i in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in lps)

    # Text: reasoning, content and tool calls are the same either way.
    assert streamed["reasoning"] == (message["reasoning"] or "")
    assert streamed["content"].strip() == (message["content"] or "").strip()
    full_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    stream_calls = [(t["name"], t["arguments"]) for _, t in sorted(streamed["tools"].items())]
    assert stream_calls == full_calls
    assert all(t["id"].startswith("chatcmpl-tool-") for t in streamed["tools"].values())
    assert streamed["finish"] == choice["finish_reason"]

    # The visible text is the detokenized ids (special tokens skipped).
    visible = tokenizer.decode(ids, skip_special_tokens=True)
    assert visible.startswith("<think>\n")
    assert visible.endswith("</tool_call>" if full_calls else message["content"])
    if full_calls:
        assert choice["finish_reason"] == "tool_calls"
    else:
        assert choice["finish_reason"] == "stop"


def test_turns_follow_the_script(http: httpx.Client) -> None:
    def turn(n: int) -> dict[str, Any]:
        return http.post(
            "/v1/chat/completions", json=request(conversation_at(n), stream=False)
        ).json()["choices"][0]

    first = turn(0)["message"]
    assert first["reasoning"] == "\nFirst, list the directory.\n"
    assert first["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in first["tool_calls"]] == [
        {"cmd": "ls -la"}
    ]

    second = turn(1)["message"]  # no scripted reasoning: Qwen3 still writes an empty think block
    assert second["reasoning"] == "\n\n"
    # vLLM keeps the newlines Qwen3 writes after </think>.
    assert second["content"] == "\n\nNow I will read the notes file.\n"

    third = turn(2)["message"]
    assert [c["function"]["name"] for c in third["tool_calls"]] == ["run_shell", "run_shell"]
    assert json.loads(third["tool_calls"][1]["function"]["arguments"]) == {
        "cmd": 'grep -n "TODO" notes.txt',
        "timeout": 5,
    }
    assert "ünïcödé ✓" in third["reasoning"]

    last = turn(3)
    assert last["finish_reason"] == "stop" and "tool_calls" not in last["message"]
    assert (
        last["message"]["content"]
        == "\n\nAll done: the directory was listed, notes.txt read, counted and searched."
    )

    messages = conversation_at(3) + [
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more?"},
    ]
    past = http.post("/v1/chat/completions", json=request(messages, stream=False)).json()[
        "choices"
    ][0]
    assert past["message"]["content"] == "\n\nThe scripted conversation has ended."


def test_output_ids_are_the_template_rendering_of_the_turn(demo: Server, tokenizer) -> None:
    body = request(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How long is notes.txt?"},
        ],
        stream=False,
    )
    choice = httpx.post(f"{demo.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][
        0
    ]
    reasoning = "The user wants to know how long notes.txt is. I will count its lines with wc before answering."
    call = json.dumps({"name": "run_shell", "arguments": {"cmd": "wc -l notes.txt"}})
    written = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    assert choice["token_ids"] == tokenizer.encode(written, add_special_tokens=False)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == written.removesuffix(
        "<|im_end|>"
    )
    assert (
        choice["message"]["reasoning_content"] == f"\n{reasoning}\n"
    )  # --reasoning-field reasoning_content
    assert "reasoning" not in choice["message"]


def test_chunking_with_several_tokens_per_chunk(demo: Server) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How long is notes.txt?"},
    ]
    full = httpx.post(
        f"{demo.url}/v1/chat/completions", json=request(messages, stream=False), timeout=30
    ).json()
    events = sse_events(
        httpx.post(
            f"{demo.url}/v1/chat/completions", json=request(messages, stream=True), timeout=30
        ).text
    )
    sizes = [
        len(e["choices"][0]["token_ids"]) for e in events[1:] if e != "[DONE]" and e["choices"]
    ]
    assert sizes[0] == 1 and all(0 < s <= 3 for s in sizes) and max(sizes) == 3
    streamed = assemble(events)
    assert streamed["ids"] == full["choices"][0]["token_ids"]
    assert streamed["tools"][0]["name"] == "run_shell"
    assert json.loads(streamed["tools"][0]["arguments"]) == {"cmd": "wc -l notes.txt"}
    assert streamed["reasoning"] == full["choices"][0]["message"]["reasoning_content"]


def test_a_request_stream_interval_batches_tokens_as_vllm_does(http: httpx.Client) -> None:
    """vLLM >= 0.32's per-request `stream_interval` (chat and completions): the first token
    alone, then that many a chunk, the rest with the finish; the same ids and logprobs in the
    end; below 1 is a 400."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How long is notes.txt?"},
    ]
    full = http.post("/v1/chat/completions", json=request(messages, stream=False)).json()
    ids = full["choices"][0]["token_ids"]
    assert len(ids) > 9
    body = request(messages, stream=True, stream_interval=4)
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    sizes = [
        len(e["choices"][0]["token_ids"]) for e in events[1:] if e != "[DONE]" and e["choices"]
    ]
    assert sizes[0] == 1 and set(sizes[1:-1]) == {4} and 0 < sizes[-1] <= 4, sizes
    assert assemble(events)["ids"] == ids

    prompt = {"model": MODEL, "prompt": full["prompt_token_ids"], "max_tokens": 200}
    whole = http.post("/v1/completions", json={**prompt, "logprobs": 0}).json()["choices"][0]
    stream = {**prompt, "stream": True, "return_token_ids": True, "logprobs": 0}
    chunks = [
        e["choices"][0]
        for e in sse_events(
            http.post("/v1/completions", json={**stream, "stream_interval": 4}).text
        )
        if e != "[DONE]" and e["choices"]
    ]
    sizes = [len(c["token_ids"]) for c in chunks]
    assert sizes[0] == 1 and set(sizes[1:-1]) == {4} and 0 < sizes[-1] <= 4, sizes
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    lps = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert lps == whole["logprobs"]["token_logprobs"]

    for path, bad in (("/v1/chat/completions", body), ("/v1/completions", stream)):
        r = http.post(path, json={**bad, "stream_interval": 0})
        assert r.status_code == 400 and "stream_interval" in r.text, r.text


# A script that holds its stream's last chunk until POST /_polar/release (at most 30 s).
HELD = {
    "name": "held",
    "match": {"user_contains": "HOLD"},
    "turns": [{"content": "held until released", "hold_last": True}],
}


def test_token_rate_paces_the_stream(demo: Server) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How long is notes.txt?"},
    ]
    arrivals: list[tuple[float, int]] = []
    with httpx.stream(
        "POST", f"{demo.url}/v1/chat/completions", json=request(messages, stream=True), timeout=30
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                if event["choices"] and "token_ids" in event["choices"][0]:
                    arrivals.append((time.monotonic(), len(event["choices"][0]["token_ids"])))
    n = sum(k for _, k in arrivals)
    spread = arrivals[-1][0] - arrivals[0][0]
    # 400 tokens/s: the tokens after the first chunk take (n - 1) / 400 s to "generate". A busy
    # machine makes the stream slower, never faster: the lower bound is the property.
    assert n > 30 and spread >= 0.8 * (n - 1) / 400


def test_turn_knobs_delay_finish_reason_and_unknown_keys(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "[knobs] go"}]
    started = time.monotonic()
    full = http.post("/v1/chat/completions", json=request(messages, stream=False, tools=())).json()
    assert time.monotonic() - started >= 0.3
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length"  # the override, though the turn ended with EOS
    assert choice["token_ids"][-1] == IM_END
    assert choice["message"]["content"] == "\n\nSlow, and reported as truncated."
    events = sse_events(
        http.post("/v1/chat/completions", json=request(messages, stream=True, tools=())).text
    )
    assert assemble(events)["finish"] == "length"


def test_stream_chunk_shapes_match_vllm(http: httpx.Client) -> None:
    body = request(conversation_at(0), stream=True, logprobs=False, return_token_ids=False)
    body["stream_options"] = {"include_usage": False}
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    first, last = events[0], events[-2]
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert first["prompt_token_ids"] is None  # explicitly set by vLLM, so present as null
    middle = events[1]
    assert set(middle) == {"id", "object", "created", "model", "choices"}
    assert list(middle["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "token_ids",
    ]
    assert middle["choices"][0]["token_ids"] is None
    assert list(last["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert (
        last["choices"][0]["finish_reason"] == "tool_calls"
        and last["choices"][0]["stop_reason"] is None
    )
    assert all(
        e == "[DONE]" or e["choices"] for e in events
    )  # no usage chunk without include_usage
    name_delta = next(e for e in events[1:-1] if e["choices"][0]["delta"].get("tool_calls"))[
        "choices"
    ][0]["delta"]
    assert name_delta["content"] is None
    (call,) = name_delta["tool_calls"]
    assert list(call) == ["id", "type", "index", "function"] and call["function"] == {
        "name": "run_shell"
    }


def test_max_tokens_truncates_with_finish_length(http: httpx.Client) -> None:
    body = request(conversation_at(3), stream=False, max_completion_tokens=5)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert IM_END not in choice["token_ids"]
    events = sse_events(
        http.post(
            "/v1/chat/completions", json=request(conversation_at(3), stream=True, max_tokens=5)
        ).text
    )
    streamed = assemble(events)
    assert streamed["ids"] == choice["token_ids"] and streamed["finish"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 5


def test_thinking_disabled_closes_the_think_block_in_the_prompt(
    http: httpx.Client, tokenizer
) -> None:
    messages = conversation_at(0)
    body = request(messages, stream=False, chat_template_kwargs={"enable_thinking": False})
    choice = http.post("/v1/chat/completions", json=body).json()
    normalized = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look around,\nthen report."},
    ]
    assert choice["prompt_token_ids"] == template_ids(
        tokenizer, normalized, [RUN_SHELL], enable_thinking=False
    )
    out = choice["choices"][0]
    assert tokenizer.decode(out["token_ids"]).startswith(
        "<tool_call>"
    )  # no reasoning after a closed think block
    assert out["message"]["reasoning"] is None and out["finish_reason"] == "tool_calls"
    events = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert assemble(events)["tools"][0]["arguments"] == '{"cmd": "ls -la"}'


# -- the openai SDK -------------------------------------------------------------------------


def test_openai_sdk_parses_every_reply(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="polar-test", max_retries=0)
    extra = {"return_token_ids": True}
    for turn in range(4):
        messages = conversation_at(turn)
        full = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[RUN_SHELL], logprobs=True, extra_body=extra
        )
        choice = full.choices[0]
        assert choice.model_extra["token_ids"][-1] == IM_END
        assert (
            len(choice.logprobs.content)
            == len(choice.model_extra["token_ids"])
            == full.usage.completion_tokens
        )
        assert full.model_extra["prompt_token_ids"]

        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=[RUN_SHELL],
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
        )
        ids = [
            i
            for c in chunks
            if c.choices
            for i in (c.choices[0].model_extra.get("token_ids") or [])
        ]
        assert ids == choice.model_extra["token_ids"] and chunks[-1].usage.completion_tokens == len(
            ids
        )

        with client.chat.completions.stream(
            model=MODEL, messages=messages, tools=[RUN_SHELL], extra_body=extra
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        got = [
            (c.function.name, c.function.arguments)
            for c in final.choices[0].message.tool_calls or []
        ]
        want = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert got == want
        if turn < 3:
            assert got and got[0][0] == "run_shell"
        assert final.choices[0].finish_reason == choice.finish_reason

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert [m.id for m in client.models.list()] == [MODEL]


# -- errors ---------------------------------------------------------------------------------


def test_unknown_model_is_vllms_404(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `gpt-4o` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_malformed_json_is_vllms_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["type"] == "Bad Request" and error["param"] == "body.10"
    assert "json_invalid" in error["message"] and "JSON decode error" in error["message"]
    missing = http.post("/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.messages"
    unknown = http.get("/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json() == {"detail": "Not Found"}


# -- other endpoints ------------------------------------------------------------------------


def test_models_health_and_request_log(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission"

    assert http.post("/_polar/reset").json() == {"ok": True}
    raw = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "marker-7f3a"}]}, indent=1
    ).encode()
    http.post(
        "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json", "x-probe": "yes"},
    )
    log = http.get("/_polar/requests").json()
    assert len(log) == 1
    (entry,) = log
    assert entry["method"] == "POST" and entry["path"] == "/v1/chat/completions"
    assert entry["raw"] == raw.decode() and entry["body"]["messages"][0]["content"] == "marker-7f3a"
    assert entry["headers"]["x-probe"] == "yes"
    http.get("/v1/models")
    assert [e["path"] for e in http.get("/_polar/requests").json()] == [
        "/v1/chat/completions",
        "/v1/models",
    ]
    http.post("/_polar/reset")
    assert http.get("/_polar/requests").json() == []


def test_hold_last_waits_for_release(server: Server) -> None:
    async def scenario() -> None:
        body = request([{"role": "user", "content": "[hold] please"}], stream=True, tools=())
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            lines = response.aiter_lines()

            async def next_event() -> Any:
                async for line in lines:
                    if line.startswith("data: "):
                        payload = line[len("data: ") :]
                        return payload if payload == "[DONE]" else json.loads(payload)
                return None

            # Everything up to the final chunk arrives while the server holds the rest.
            content = ""
            while not content.endswith("This reply waits for its last chunk."):
                event = await asyncio.wait_for(next_event(), 10)
                assert event["choices"][0]["finish_reason"] is None
                content += event["choices"][0]["delta"].get("content") or ""
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(pending := asyncio.ensure_future(next_event())), 0.5
                )
            assert (await client.post("/_polar/release")).json() == {"released": 1}
            final = await asyncio.wait_for(pending, 10)
            assert final["choices"][0]["finish_reason"] == "stop"
            rest = [await asyncio.wait_for(next_event(), 10) for _ in range(2)]
            assert rest[0]["choices"] == [] and rest[1] == "[DONE]"

    asyncio.run(scenario())


def test_concurrent_streams_do_not_block_each_other(tmp_module: Path) -> None:
    """One stream is held open (its last chunk waits for POST /_polar/release) while 16 others
    run start to end: shown by order, not by the clock, so a busy machine cannot fail it."""
    scenario = json.loads((SCENARIOS / "tool_loop.json").read_text())
    scenario["scripts"].insert(0, HELD)
    path = tmp_module / "tool_loop_held.json"
    path.write_text(json.dumps(scenario))
    server = Server(tmp_module, "--scenario", str(path))

    async def one(client: httpx.AsyncClient, turn: int) -> int:
        response = await client.post(
            "/v1/chat/completions", json=request(conversation_at(turn % 4), stream=True)
        )
        streamed = assemble(sse_events(response.text))
        return len(streamed["ids"])

    async def held(client: httpx.AsyncClient, streaming: asyncio.Event) -> str:
        body = request([{"role": "user", "content": "HOLD"}], stream=True, tools=())
        parts = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for part in response.aiter_text():
                streaming.set()
                parts.append(part)
        return assemble(sse_events("".join(parts)))["content"]

    async def many() -> tuple[list[int], str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            streaming = asyncio.Event()
            first = asyncio.create_task(held(client, streaming))
            await asyncio.wait_for(streaming.wait(), 60)
            counts = await asyncio.gather(*(one(client, i) for i in range(16)))
            assert not first.done(), "the held stream ended before the others (not held?)"
            released = (await client.post("/_polar/release")).json()["released"]
            assert released == 1
            return counts, await first

    try:
        counts, text = asyncio.run(many())
    finally:
        server.stop()
    assert all(c > 5 for c in counts) and len(set(counts[::4])) == 1
    assert text.strip() == "held until released"


@pytest.mark.parametrize(
    ("limits", "n_prompt", "max_tokens", "want"),
    [
        # vLLM 0.33: a cap that only does not fit beside the prompt is clamped, silently
        ("0.33", 11435, 128000, 131072 - 11435),
        ("0.33", 100, None, 32768 - 100),
        ("0.33", 100, 50, 50),
        ("0.33", 100, 128000, "max_tokens=128000 cannot be greater than max_model_len=32768"),
        ("0.33", 40000, 10, "which exceeds this limit even without any output tokens"),
        ("0.33", 40000, 128000, "cannot be greater than max_model_len"),  # the cap is checked first
        ("0.33", 32768, None, "max_tokens must be at least 1, got 0"),
        # vLLM 0.10: prompt + cap beyond the context refused
        ("0.10", 11435, 128000, "'max_tokens' or 'max_completion_tokens' is too large: 128000"),
        ("0.10", 40000, 10, "your request has 40000 input tokens"),
        # SGLang 0.5.23
        ("sglang", 11435, 128000, "Requested token count exceeds the model's maximum context"),
        ("sglang", 40000, None, "The input (40000 tokens) is longer than the model's context"),
    ],
)
def test_token_limits_of_each_server(limits, n_prompt, max_tokens, want) -> None:
    from polar_reference.generation import token_limit

    from polar_mitm.tokens.conversation import RequestError

    context = 131072 if n_prompt == 11435 and limits == "0.33" else 32768
    if isinstance(want, int):
        assert token_limit(n_prompt, max_tokens, context, limits) == want
    else:
        with pytest.raises(RequestError) as e:
            token_limit(n_prompt, max_tokens, context, limits)
        assert want in str(e.value)


def test_its_own_console_script_and_not_the_products_cli() -> None:
    """The server is a package of its own (reference/pyproject.toml): `polar-reference` is its
    command, and the product's `polar-mitm` CLI, which a plain install ships alone, has none."""
    bin_dir = Path(sys.executable).parent
    own = subprocess.run(
        [str(bin_dir / "polar-reference"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert own.returncode == 0 and "--scenario" in own.stdout, own.stderr
    product = subprocess.run(
        [str(bin_dir / "polar-mitm"), "policy-server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert product.returncode == 2 and "No such command 'policy-server'" in product.stderr
