"""The reference policy server kept honest: the same requests to it and to the real vLLM, and any
difference in what the proxy and the tests rely on fails: status codes, content types, the JSON
shape of every reply, stream chunk and error (field names, value types, presence, nulls
included), the kinds of stream chunks in order, and the ids (the scripts are the same, so the
prompt and output ids must be too). Where they differed, the reference server was changed to
the real vLLM's (docs/real-vllm.md lists what).

One allowance, vLLM's own: when its HTTP side lags behind the engine (a busy machine), it merges
the waiting deltas into one chunk (``RequestOutputCollector.put`` in vllm/v1/engine/
output_processor.py). A real chunk of several tokens must then be exactly the merge of the
reference's chunks for those tokens; everything else stays as strict.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from polar_reference.vllm_launch import SERVED_MODEL

from tests.helpers.clients import RUN_SHELL

from .conftest import SCENARIOS

LOOP = [
    {"role": "system", "content": "You are a coding agent. Use run_shell."},
    {"role": "user", "content": "How many lines does notes.txt have?"},
]
HELLO = [{"role": "user", "content": "[chat] hi"}]
TOKENS = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
CHAT = "/v1/chat/completions"
CASES: dict[str, tuple[str, Any]] = {
    "tool call": (CHAT, {"messages": LOOP, "tools": [RUN_SHELL], **TOKENS}),
    "tool call, streamed": (CHAT, {"messages": LOOP, "tools": [RUN_SHELL], **TOKENS, **STREAM}),
    "text": (CHAT, {"messages": HELLO, **TOKENS}),
    "text, streamed": (CHAT, {"messages": HELLO, **TOKENS, **STREAM}),
    "thinking off": (
        CHAT,
        {"messages": HELLO, **TOKENS, "chat_template_kwargs": {"enable_thinking": False}},
    ),
    "no token flags": (CHAT, {"messages": HELLO}),
    "cap above the context": (CHAT, {"messages": LOOP, "max_tokens": 50_000}),
    "prompt above the context": (
        CHAT,
        {"messages": [{"role": "user", "content": "lorem " * 50_000}]},
    ),
    "unknown model": (CHAT, {"model": "nope", "messages": LOOP}),
    "messages not a list": (CHAT, {"messages": "not a list"}),
    "not JSON": (CHAT, b"{not json"),
}
COMPLETIONS = {"max_tokens": 100, "logprobs": 0, "return_token_ids": True}


def shape(value: Any) -> Any:
    """Field names and value types, lists as the set of their elements' shapes."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return sorted({json.dumps(shape(v), sort_keys=True) for v in value})
    return "null" if value is None else type(value).__name__


def chunk_kind(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return "usage"
    delta = choices[0].get("delta", {})
    kind = "+".join(sorted(k for k, v in delta.items() if v not in (None, "", []))) or "empty"
    return kind + ("|finish" if choices[0].get("finish_reason") else "")


def said(chunks: list[dict]) -> dict[str, Any]:
    """What a stream says, whatever its chunking: its reasoning, text and tool calls, joined."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "text": "", "calls": {}}
    for c in chunks:
        for ch in c.get("choices") or ():
            out["text"] += ch.get("text") or ""  # /v1/completions
            delta = ch.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                name, args = out["calls"].get(call["index"], ("", ""))
                name += function.get("name") or ""
                out["calls"][call["index"]] = (name, args + (function.get("arguments") or ""))
    return out


def read_stream(text: str) -> dict[str, Any]:
    chunks = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]
    kinds = [chunk_kind(c) for c in chunks]
    return {
        "kinds": kinds,
        "counts": [
            sum(len(ch.get("token_ids") or ()) for ch in c.get("choices") or ()) for c in chunks
        ],
        # one shape per kind of chunk: the same kind must look the same on both servers
        "shapes": {k: shape(c) for k, c in zip(kinds, chunks, strict=True)},
        "ids": (
            next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), None),
            [i for c in chunks for ch in c.get("choices") or () for i in ch.get("token_ids") or ()],
        ),
        "said": said(chunks),
        "done": text.rstrip().endswith("data: [DONE]"),
    }


def ask(url: str, path: str, body: Any) -> dict[str, Any]:
    if isinstance(body, bytes):
        r = httpx.post(
            url + path, content=body, headers={"content-type": "application/json"}, timeout=120
        )
    else:
        r = httpx.post(url + path, json={"model": SERVED_MODEL, **body}, timeout=120)
    out: dict[str, Any] = {"status": r.status_code, "type": r.headers.get("content-type")}
    if out["type"].startswith("text/event-stream"):
        out |= read_stream(r.text)
    else:
        reply = r.json()
        out["shape"] = shape(reply)
        if r.status_code == 200:
            choice = reply["choices"][0]
            prompt = reply.get("prompt_token_ids") or choice.get("prompt_token_ids")
            out["ids"] = (prompt, choice.get("token_ids"))
        else:
            out["error"] = {k: reply["error"][k] for k in ("type", "param", "code")}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.helpers.procs import start_policy_server

    server = start_policy_server(
        tmp_path_factory.mktemp("reference"),
        SCENARIOS[0],
        ["--max-model-len", "40960", "--enable-scale-out"],
    )
    yield server
    server.stop()


def merged_kind(kinds: list[str]) -> str:
    """The kind of one chunk holding the deltas of ``kinds``' chunks (empty deltas add nothing)."""
    parts = {p for k in kinds for p in k.split("|")[0].split("+")} - {"empty"}
    return ("+".join(sorted(parts)) or "empty") + (
        "|finish" if kinds[-1].endswith("|finish") else ""
    )


def merges_into(ref: dict, real: dict) -> bool:
    """Whether the real stream is the reference's with some neighbouring token chunks merged."""
    i, n = 0, len(ref["kinds"])
    for kind, count in zip(real["kinds"], real["counts"], strict=True):
        j, tokens = i, 0
        while j < n and (tokens < count or j == i):
            tokens, j = tokens + ref["counts"][j], j + 1
        if tokens != count or merged_kind(ref["kinds"][i:j]) != kind:
            return False
        i = j
    return i == n


def allow_merged_chunks(ref: dict, real: dict) -> tuple[dict, dict]:
    """Both streams without their chunking, once the real one is shown to be a merge of the
    reference's; the shapes of the kinds both have stay compared."""
    if "counts" not in real or max(real["counts"], default=0) <= 1:
        return ref, real
    assert merges_into(ref, real), "vLLM merged chunks, but not the reference's: {} from {}".format(
        *(list(zip(o["kinds"], o["counts"], strict=True)) for o in (real, ref))
    )
    common = ref["shapes"].keys() & real["shapes"].keys()

    def unchunked(out: dict) -> dict:
        rest = {k: v for k, v in out.items() if k not in ("kinds", "counts", "shapes")}
        return rest | {"shapes": {k: out["shapes"][k] for k in sorted(common)}}

    return unchunked(ref), unchunked(real)


def same(ref: dict, real: dict, case: str) -> None:
    ref, real = allow_merged_chunks(ref, real)
    if "error" in ref and "error" in real and real["error"]["type"] == "Bad Request":
        # pydantic's own validation errors (the request never reached vLLM's code): the
        # reference answers in vLLM's words for its own checks; the shape is what counts
        ref, real = (
            {k: v for k, v in ref.items() if k != "error"},
            {k: v for k, v in real.items() if k != "error"},
        )
    assert ref == real, f"{case}: the reference server differs from vLLM"


@pytest.mark.parametrize("case", list(CASES))
def test_chat_shapes(vllm, reference, case):
    path, body = CASES[case]
    same(ask(reference.url, path, body), ask(vllm.url, path, body), case)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_token_in_shapes(vllm, reference, stream):
    prompt = ask(vllm.url, CHAT, CASES["tool call"][1])["ids"][0]
    body = {"prompt": prompt, **COMPLETIONS, **(STREAM if stream else {})}
    same(
        ask(reference.url, "/v1/completions", body),
        ask(vllm.url, "/v1/completions", body),
        "completions",
    )
    too_long = {"prompt": prompt * 300, **COMPLETIONS}
    same(
        ask(reference.url, "/v1/completions", too_long),
        ask(vllm.url, "/v1/completions", too_long),
        "completions, prompt above the context",
    )


def test_generate_shapes(vllm, reference):
    """vLLM 0.32's /inference/v1/generate (the tier's server runs with --enable-scale-out), as
    polar_token_in=generate asks it: ids and logprobs, no text; and a stop string refused."""
    prompt = ask(vllm.url, CHAT, CASES["tool call"][1])["ids"][0]
    params = {"max_tokens": 100, "logprobs": 0, "detokenize": False}
    body = {"token_ids": prompt, "sampling_params": params, "output_mode": "tokens"}
    path = "/inference/v1/generate"
    same(ask(reference.url, path, body), ask(vllm.url, path, body), "generate")
    stop = {**body, "sampling_params": {**params, "stop": ["x"]}}
    same(ask(reference.url, path, stop), ask(vllm.url, path, stop), "generate, stop strings")


def test_merged_chunks_allowed_and_nothing_else(reference, tmp_path):
    """The allowance above, against the reference itself: its own chunks merged three tokens at a
    time pass; a kind or a token moved does not."""
    from tests.helpers.procs import start_policy_server

    merged = start_policy_server(
        tmp_path, SCENARIOS[0], ["--max-model-len", "40960", "--chunk-tokens", "3"], "merged"
    )
    try:
        path, body = CASES["tool call, streamed"]
        ref, real = ask(reference.url, path, body), ask(merged.url, path, body)
    finally:
        merged.stop()
    assert max(real["counts"]) == 3 and real["kinds"] != ref["kinds"]
    same(ref, real, "merged three at a time")
    moved = real["kinds"].index("tool_calls")
    for broken in (
        real | {"kinds": real["kinds"][:moved] + ["content"] + real["kinds"][moved + 1 :]},
        real | {"counts": [*real["counts"][:-3], real["counts"][-3] + 1, *real["counts"][-2:]]},
    ):
        with pytest.raises(AssertionError, match="vLLM merged chunks"):
            same(ref, broken, "broken")


def test_models_shape(vllm, reference):
    ref, real = (httpx.get(u + "/v1/models", timeout=30).json() for u in (reference.url, vllm.url))
    assert shape(ref) == shape(real)
    assert ref["data"][0]["max_model_len"] == real["data"][0]["max_model_len"] == 40960
