"""Exact-prefix mode end to end: real mitmdump + addon (polar_exact_prefix), real HTTPS through the
proxy with the openai SDK, the reference policy server's token-in endpoint (vLLM /v1/completions,
SGLang /generate) computing with the real Qwen3 tokenizer and template.

The harness here drifts the way real ones do: it drops the reasoning of earlier turns, sends tool
arguments back re-serialized in another key order, and then asks a follow-up question (Qwen3's
template itself drops earlier reasoning after a new user turn). In chat mode that breaks the chain
(`rerender`); in exact-prefix mode the same conversation is one chain, and the SDK sees the same
replies.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.store import read_table
from tests.e2e.loopback.test_fidelity_e2e import cli
from tests.helpers import ROOT, TESTS
from tests.helpers.clients import RUN_SHELL, messages_next, openai_client
from tests.helpers.procs import MITMDUMP
from tests.helpers.upstreams import direct_ids

SCENARIO = TESTS / "scenarios" / "exact_prefix.json"
OUTPUTS = {"ls": "notes.txt", "tail -1 notes.txt": "gamma"}
MODEL = "gpt-4.1-mini"


def ask(client: openai.OpenAI, messages: list[dict], stream: bool) -> dict[str, Any]:
    """One call; the reply as the SDK hands it over (text, reasoning, tool calls, finish)."""
    if not stream:
        c = client.chat.completions.create(model=MODEL, messages=messages, tools=[RUN_SHELL])
        m = c.choices[0].message
        calls = [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in m.tool_calls or ()
        ]
        reasoning = (m.model_extra or {}).get("reasoning")
        return {
            "content": m.content,
            "reasoning": reasoning,
            "tool_calls": calls,
            "finish": c.choices[0].finish_reason,
            "model": c.model,
        }
    content, reasoning, calls, finish, model = [], [], {}, None, None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[RUN_SHELL], stream=True
    ):
        model = chunk.model
        for choice in chunk.choices:
            d = choice.delta
            content.append(d.content or "")
            reasoning.append((d.model_extra or {}).get("reasoning") or "")
            for t in d.tool_calls or ():
                entry = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = t.id or entry["id"]
                entry["name"] += (t.function.name or "") if t.function else ""
                entry["arguments"] += (t.function.arguments or "") if t.function else ""
            finish = choice.finish_reason or finish
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
        "model": model,
    }


def converse(client: openai.OpenAI, stream: bool, drift: bool) -> tuple[list[dict], list[list]]:
    """The tool loop, then a follow-up question. With `drift`, the harness drops reasoning and
    re-serializes tool arguments with their keys reversed. Returns replies and messages sent."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "What is the last line of notes.txt?"},
    ]
    replies, sent = [], []
    for _ in range(3):
        sent.append(json.loads(json.dumps(messages)))
        reply = ask(client, messages, stream)
        replies.append(reply)
        turn: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
        if not drift and reply["reasoning"]:
            turn["reasoning"] = reply["reasoning"]
        if reply["tool_calls"]:
            turn["tool_calls"] = []
            for call in reply["tool_calls"]:
                args = call["arguments"]
                if drift:
                    args = json.dumps(dict(reversed(list(json.loads(args).items()))))
                turn["tool_calls"].append(
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": args},
                    }
                )
        messages.append(turn)
        for call in reply["tool_calls"]:
            cmd = json.loads(call["arguments"])["cmd"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": OUTPUTS[cmd]})
        if not reply["tool_calls"]:
            break
    if drift:
        messages.append({"role": "user", "content": "Anything else in it?"})
        sent.append(json.loads(json.dumps(messages)))
        replies.append(ask(client, messages, stream))
    return replies, sent


def seen(reply: dict) -> tuple:
    """What a harness acts on: text, reasoning, tool calls (arguments as values), finish."""
    calls = [(c["name"], json.loads(c["arguments"])) for c in reply["tool_calls"]]
    # Whitespace-only text before a tool call is no text: SGLang streams it as content (its
    # stream parser passes it on), its whole replies strip it, and the token-in path is a whole
    # reply while the chat path streams with sglext ids.
    content = reply["content"] if (reply["content"] or "").strip() else None
    return content, reply["reasoning"], calls, reply["finish"], reply["model"]


def records(output: Path, rollout: str) -> tuple[list[dict], list[dict]]:
    calls = [c for c in read_table(str(output), "calls").to_pylist() if c["rollout_id"] == rollout]
    traces = [
        t for t in read_table(str(output), "traces").to_pylist() if t["rollout_id"] == rollout
    ]
    return sorted(calls, key=lambda c: c["started_at"]), traces


@pytest.mark.parametrize(("kind", "stream"), [("vllm", True), ("vllm", False), ("sglang", True)])
def test_enforce_mode_removes_the_drift_chat_mode_has(make_policy_server, make_mitm, kind, stream):
    server = make_policy_server(SCENARIO, kind=kind)
    tok = str(qwen3_tokenizer_dir())
    chat_mitm = make_mitm(server.url, polar_tokenizer=tok, polar_upstream_kind=kind)
    exact_mitm = make_mitm(
        server.url,
        polar_tokenizer=tok,
        polar_upstream_kind=kind,
        polar_exact_prefix="true",
        polar_exact_compare="true",
    )
    with openai_client(chat_mitm, api_key="polar-drift.0") as client:
        chat_replies, _ = converse(client, stream, drift=True)
    with openai_client(exact_mitm, api_key="polar-drift.1") as client:
        exact_replies, _ = converse(client, stream, drift=True)
    assert chat_mitm.stop() == 0, chat_mitm.proc.output()
    assert exact_mitm.stop() == 0, exact_mitm.proc.output()

    # the harness's view is the same on both paths
    assert [seen(r) for r in exact_replies] == [seen(r) for r in chat_replies]
    assert len(exact_replies) == 4 and exact_replies[0]["tool_calls"]
    assert exact_replies[0]["finish"] == "tool_calls" and exact_replies[-1]["finish"] == "stop"

    # chat mode: the re-rendered turns break the chain
    calls, traces = records(chat_mitm.output, "drift.0")
    assert [c["route"] for c in calls] == ["chat"] * 4
    assert "rerender" in {t["break_reason"] for t in traces}
    assert any("template_rerender" in c["fidelity_flags"] for c in calls)

    # exact-prefix mode: every later call extends the chain, one trace, nothing re-rendered
    calls, traces = records(exact_mitm.output, "drift.1")
    assert [c["route"] for c in calls] == ["chat", "token_in", "token_in", "token_in"]
    assert all(c["status"] == "completed" and c["trainable"] for c in calls), calls
    assert not any("template_rerender" in c["fidelity_flags"] for c in calls)
    notes = [json.loads(c["fidelity_json"])["exact_prefix"] for c in calls]
    assert notes[0] == {"path": "chat", "reason": "no_chain"}
    for before, call, note in zip(calls[:-1], calls[1:], notes[1:], strict=True):
        assert note["path"] == "token_in" and note["extends_call"] == before["call_id"]
        chain = before["prompt_token_ids"] + before["output_token_ids"]
        assert call["prompt_token_ids"][: len(chain)] == chain  # the policy's own tokens
        assert note["chain_tokens"] == len(chain)
        # polar_exact_compare: the drifting harness's chat-mode prompt differs from some point on
        assert note["drift_tokens"] > 0 and note["first_diff"] < len(chain)
    [trace] = traces
    assert trace["break_reason"] == "first_call" and trace["status"] == "incomplete"
    last = calls[-1]
    assert trace["input_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
    sampled = sum(len(c["output_token_ids"]) for c in calls)
    assert sum(trace["loss_mask"]) == sampled
    masked = [lp for lp, m in zip(trace["logprobs"], trace["loss_mask"], strict=True) if m]
    assert masked == pytest.approx([lp for c in calls for lp in c["output_logprobs"]])

    # the report shows what exact-prefix mode removed
    report = cli("fidelity", str(exact_mitm.output), "--json")
    assert report.returncode == 0, report.stderr
    exact = json.loads(report.stdout)["total"]["exact_prefix"]
    assert exact["token_in_calls"] == exact["compared"] == 3 and exact["chat_calls"] == 1
    assert exact["calls_drift_removed"] == 3
    assert exact["drift_tokens_removed"] == sum(n["drift_tokens"] for n in notes[1:])


def test_a_clean_conversation_gets_the_chat_prompt_ids(make_policy_server, make_mitm):
    """A harness that sends every turn back as it came: the token-in prompts are exactly the ids
    the server's own chat template gives the same messages (the continuation is rendered right).
    Non-streaming: a streamed tool-call turn hands the "\n\n" after </think> back as content,
    which chat mode re-renders differently (a real drift, which exact-prefix mode removes)."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url,
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_exact_prefix="true",
        polar_exact_compare="true",
    )
    with openai_client(mitm, api_key="polar-clean.0") as client:
        _, sent = converse(client, stream=False, drift=False)
    assert mitm.stop() == 0, mitm.proc.output()
    calls, traces = records(mitm.output, "clean.0")
    assert [c["route"] for c in calls] == ["chat", "token_in", "token_in"]
    for call, messages in zip(calls, sent, strict=True):
        truth = direct_ids(server.url, "vllm", messages, [RUN_SHELL])
        assert call["prompt_token_ids"] == truth.prompt_ids
        assert call["output_token_ids"] == truth.output_ids
    for call in calls[1:]:
        assert json.loads(call["fidelity_json"])["exact_prefix"]["drift_tokens"] == 0
    assert len(traces) == 1


def test_exact_prefix_without_a_template_tokenizer_is_one_startup_error(tmp_path, confdir):
    proc = subprocess.run(
        [
            MITMDUMP,
            "-s",
            str(ROOT / "addons" / "polar.py"),
            "--listen-port",
            "0",
            "--set",
            f"confdir={confdir}",
            "--set",
            "polar_upstream=http://127.0.0.1:9",
            "--set",
            f"polar_output={tmp_path / 'out'}",
            "--set",
            "polar_exact_prefix=true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "polar_exact_prefix: needs polar_tokenizer" in out and "Traceback" not in out


def _messages_conversation(mitm, rollout: str) -> tuple[list, list]:
    """Claude Code's dialect through the anthropic SDK (streamed): what the SDK assembled."""
    from tests.e2e.loopback.test_dialects_e2e import (
        ANTHROPIC_TOOL,
        QUESTION,
        SYSTEM,
        anthropic_client,
    )

    client = anthropic_client(mitm, api_key=f"polar-{rollout}")
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    seen_by_sdk = []
    for _ in range(3):
        with client.messages.stream(
            model="claude-sonnet-4-5",
            max_tokens=1024,
            system=SYSTEM,
            messages=messages,
            tools=[ANTHROPIC_TOOL],
        ) as s:
            final = s.get_final_message()
        blocks = [
            (
                b.type,
                getattr(b, "text", None),
                getattr(b, "thinking", None),
                getattr(b, "input", None),
            )
            for b in final.content
        ]
        seen_by_sdk.append((final.stop_reason, blocks, final.usage.output_tokens))
        more, used = messages_next(final, lambda u: "3 notes.txt")
        messages += more
        if not used:
            break
    return seen_by_sdk, messages


def _responses_conversation(mitm, rollout: str) -> tuple[list, list]:
    """Codex's dialect through the openai SDK's Responses stream; reasoning items are sent back
    without their text (as a harness that keeps only the encrypted content might)."""
    from tests.e2e.loopback.test_dialects_e2e import QUESTION, RESPONSES_TOOL, SYSTEM

    client = openai_client(mitm, api_key=f"polar-{rollout}")
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    seen_by_sdk = []
    for _ in range(3):
        with client.responses.stream(
            model="gpt-5", instructions=SYSTEM, input=items, tools=[RESPONSES_TOOL], store=False
        ) as s:
            final = s.get_final_response()
        out = []
        for item in final.output:
            if item.type == "function_call":
                out.append((item.type, item.name, json.loads(item.arguments)))
            elif item.type == "message":
                out.append((item.type, final.output_text))
            else:
                out.append((item.type, [c.text for c in item.content or ()]))
        seen_by_sdk.append((final.status, out, final.usage.output_tokens))
        for item in final.output:
            if item.type == "function_call":
                items.append(item.model_dump(exclude_none=True))
                items.append(
                    {"type": "function_call_output", "call_id": item.call_id, "output": "3"}
                )
            elif item.type == "message":
                items.append(item.model_dump(exclude_none=True))
        if not any(i.type == "function_call" for i in final.output):
            break
    return seen_by_sdk, items


@pytest.mark.parametrize("dialect", ["anthropic_messages", "openai_responses"])
def test_the_other_dialects_see_the_same_replies(make_policy_server, make_mitm, dialect):
    from tests.e2e.loopback.test_dialects_e2e import SCENARIO as DIALECTS

    converse_in = (
        _messages_conversation if dialect == "anthropic_messages" else _responses_conversation
    )
    server = make_policy_server(DIALECTS)
    tok = str(qwen3_tokenizer_dir())
    chat_mitm = make_mitm(server.url, polar_tokenizer=tok)
    exact_mitm = make_mitm(server.url, polar_tokenizer=tok, polar_exact_prefix="true")
    chat_seen, _ = converse_in(chat_mitm, "dia.0")
    exact_seen, _ = converse_in(exact_mitm, "dia.1")
    assert chat_mitm.stop() == 0 and exact_mitm.stop() == 0
    assert exact_seen == chat_seen and len(exact_seen) == 3
    calls, traces = records(exact_mitm.output, "dia.1")
    assert [c["dialect"] for c in calls] == [dialect] * 3
    assert [c["route"] for c in calls] == ["chat", "token_in", "token_in"]
    assert all(c["status"] == "completed" for c in calls)
    # without polar_exact_compare the whole conversation is never rendered again per call
    assert all("drift_tokens" not in json.loads(c["fidelity_json"])["exact_prefix"] for c in calls)
    report = cli("fidelity", str(exact_mitm.output), "--json")
    total = json.loads(report.stdout)["total"]["exact_prefix"]
    assert total["token_in_calls"] == 2 and total["compared"] == 0
    [trace] = traces
    assert trace["input_ids"] == calls[-1]["prompt_token_ids"] + calls[-1]["output_token_ids"]
    assert sum(trace["loss_mask"]) == sum(len(c["output_token_ids"]) for c in calls)


def first_tool_turn(client: openai.OpenAI, stream: bool) -> list[dict]:
    """A chain's first call (chat) and its tool result: the messages a token-in call extends."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "What is the last line of notes.txt?"},
    ]
    [call] = ask(client, messages, stream=stream)["tool_calls"]
    function = {"name": call["name"], "arguments": call["arguments"]}
    return [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "notes.txt"},
    ]


def test_a_token_in_call_whose_server_is_gone_is_an_error_in_the_dialect(
    make_policy_server, make_mitm
):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url, polar_tokenizer=str(qwen3_tokenizer_dir()), polar_exact_prefix="true"
    )
    with openai_client(mitm, api_key="polar-gone.0") as client:
        messages = first_tool_turn(client, stream=False)
        server.stop()
        with pytest.raises(openai.APIStatusError) as failed:
            ask(client, messages, stream=True)
        assert failed.value.status_code == 502
        assert server.url in str(failed.value)
    assert mitm.stop() == 0, mitm.proc.output()
    calls, _ = records(mitm.output, "gone.0")
    assert [(c["route"], c["status"]) for c in calls] == [
        ("chat", "completed"),
        ("token_in", "error"),
    ]
    assert "unreachable" in calls[1]["error"] and calls[1]["http_status"] == 502


GENERATE = "/inference/v1/generate"
UPSTREAM_MODES = {
    "buffer": {"polar_upstream_stream": "buffer"},
    "interval": {"polar_stream_interval": "8"},
    "generate": {"polar_token_in": "generate"},
}


def assert_sent_as(mode: str, sent: list[dict]) -> None:
    """What each mode asks of the server: whole replies; 8 tokens a chunk; token-in calls to
    /inference/v1/generate, ids only."""
    llm = [u for u in sent if u["method"] == "POST" and "_polar" not in u["path"]]
    bodies = [u["body"] for u in llm]
    if mode == "buffer":
        assert [bool(b.get("stream")) for b in bodies] == [False] * len(bodies)
        assert not any("stream_interval" in b for b in bodies)
    elif mode == "interval":
        assert [(b.get("stream"), b.get("stream_interval")) for b in bodies] == [(True, 8)] * len(
            bodies
        )
    else:
        paths = [u["path"] for u in llm]
        assert paths[0] == "/v1/chat/completions" and set(paths[1:]) == {GENERATE}
        for body in bodies[1:]:
            assert body["output_mode"] == "tokens" and "stream" not in body
            params = body["sampling_params"]
            assert params["detokenize"] is False and params["logprobs"] == 0
            assert params["max_tokens"] > 0


@pytest.mark.parametrize("mode", sorted(UPSTREAM_MODES))
@pytest.mark.parametrize("dialect", ["openai_chat", "anthropic_messages", "openai_responses"])
def test_cheaper_upstream_modes_stream_the_same_to_the_harness(
    make_policy_server, make_mitm, dialect, mode
):
    """polar_upstream_stream=buffer (the server is asked for whole replies, chat and token-in
    alike), polar_stream_interval (vLLM's stream_interval: 8 tokens a chunk) and
    polar_token_in=generate (token-in through vLLM 0.32's /inference/v1/generate, ids only, the
    text decoded by the proxy): the harness still gets its own dialect's stream, the same one
    relaying every token from /v1/completions gives, and the records hold the same ids and
    logprobs."""
    import httpx

    from tests.e2e.loopback.test_dialects_e2e import SCENARIO as DIALECTS

    scenario = SCENARIO if dialect == "openai_chat" else DIALECTS
    server = make_policy_server(scenario, "--enable-scale-out")
    tok = str(qwen3_tokenizer_dir())
    relayed = make_mitm(server.url, polar_tokenizer=tok, polar_exact_prefix="true")
    cheaper = make_mitm(
        server.url, polar_tokenizer=tok, polar_exact_prefix="true", **UPSTREAM_MODES[mode]
    )

    def talk(mitm, rollout: str) -> list:
        if dialect == "openai_chat":
            with openai_client(mitm, api_key=f"polar-{rollout}") as client:
                return [seen(r) for r in converse(client, stream=True, drift=False)[0]]
        converse_in = (
            _messages_conversation if dialect == "anthropic_messages" else _responses_conversation
        )
        return converse_in(mitm, rollout)[0]

    relayed_seen = talk(relayed, "up.0")
    sent_before = len(httpx.get(server.url + "/_polar/requests", timeout=10).json())
    cheaper_seen = talk(cheaper, "up.1")
    assert relayed.stop() == 0 and cheaper.stop() == 0
    assert cheaper_seen == relayed_seen and len(cheaper_seen) >= 3
    assert_sent_as(
        mode, httpx.get(server.url + "/_polar/requests", timeout=10).json()[sent_before:]
    )

    relay_calls, _ = records(relayed.output, "up.0")
    calls, [trace] = records(cheaper.output, "up.1")
    assert [c["stream"] for c in calls] == [True] * len(calls)
    assert [c["route"] for c in calls] == [c["route"] for c in relay_calls]
    assert {c["route"] for c in calls} == {"chat", "token_in"}
    for relay, call in zip(relay_calls, calls, strict=True):
        assert call["status"] == "completed" and call["trainable"], call
        assert call["prompt_token_ids"] == relay["prompt_token_ids"]
        assert call["output_token_ids"] == relay["output_token_ids"]
        assert call["output_logprobs"] == pytest.approx(relay["output_logprobs"])
        assert call["response_json"] is not None
    last = calls[-1]
    assert trace["input_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
