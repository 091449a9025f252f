"""A captured session with every kind of rollout, produced for real: the reference policy server
(real Qwen3 tokenizer and chat template), mitmdump with the addon, HTTPS through the proxy with
its CA, rewards through the control plane. The CLI tests read what it leaves on disk.

What it runs (``tests/scenarios/trajectories.json`` scripts the model):
- ``loop.0``: a 6-turn tool loop, one main trace; ended with reward 1.0;
- ``combo.0``: a side call (title), a sub-agent, the main agent again, a compaction: 4 traces;
  ended with reward 0.5;
- GRPO group ``task``: ``task.0``..``task.3`` one chat call each, ``task.0`` / ``task.1`` ended
  with rewards 0.0 / 1.0, ``task.2`` ended without a reward, ``task.3`` left open (the proxy's
  shutdown writes it ``incomplete``);
- ``bad.0``: a malformed request (an ``error`` call) and a good one: its trace is untrainable
  (``call_error``); ended with reward 0.0;
- ``stream.0``: one streamed call; ended with reward 1.0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from polar_mitm.control import ControlClient

from . import TESTS
from .clients import RUN_SHELL, http_client
from .procs import Mitm, start_mitm, start_policy_server

SCENARIO = TESTS / "scenarios" / "trajectories.json"
TOKEN = "cli-ctl-token-7d21"
CHAT_URL = "https://api.openai.com/v1/chat/completions"
SPAWN = {
    "type": "function",
    "function": {
        "name": "spawn_agent",
        "description": "Run a sub-agent on a task and return its answer.",
        "parameters": {
            "type": "object",
            "properties": {"task": {"type": "string"}},
            "required": ["task"],
        },
    },
}
OUTPUTS = {
    "ls": "notes.txt",
    "cat notes.txt": "alpha\nbeta\ngamma\n",
    "wc -l notes.txt": "3 notes.txt",
    "grep -n TODO notes.txt": "",
    "head -1 notes.txt": "alpha",
    "tail -1 notes.txt": "gamma",
}
# what each rollout was ended with through the control plane (absent: never ended)
LIVE_REWARDS = {
    "loop.0": 1.0,
    "combo.0": 0.5,
    "task.0": 0.0,
    "task.1": 1.0,
    "task.2": None,
    "bad.0": 0.0,
    "stream.0": 1.0,
}


@dataclass
class Session:
    output: Path
    mitm_log: str


def chat(
    client: httpx.Client,
    rollout: str,
    messages: list[dict],
    tools: list[dict] | None,
    purpose: str | None = None,
) -> dict:
    body: dict = {"model": "gpt-4.1", "messages": messages}
    if tools:
        body["tools"] = tools
    headers = {"authorization": f"Bearer polar-{rollout}"}
    if purpose:
        headers["x-polar-purpose"] = purpose
    r = client.post(CHAT_URL, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def run_agent(
    client: httpx.Client, rollout: str, messages: list[dict], tools: list[dict]
) -> list[dict]:
    """A careful harness: each reply goes back verbatim, reasoning included (vLLM reads
    `reasoning`), so the chat template can re-render earlier turns as they were sampled."""
    replies = []
    for _ in range(10):
        reply = chat(client, rollout, messages, tools)
        replies.append(reply)
        assistant = {
            "role": "assistant",
            "content": reply.get("content"),
            "reasoning": reply.get("reasoning"),
        }
        if reply.get("tool_calls"):
            assistant["tool_calls"] = reply["tool_calls"]
        messages.append(assistant)
        for call in reply.get("tool_calls") or ():
            cmd = json.loads(call["function"]["arguments"])["cmd"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": OUTPUTS[cmd]})
        if not reply.get("tool_calls"):
            return replies
    raise AssertionError("the agent did not finish")


def _combo(client: httpx.Client) -> None:
    main_system = {"role": "system", "content": "[main] You lead. Delegate with spawn_agent."}
    task = {"role": "user", "content": "How many lines does notes.txt have?"}
    messages = [main_system, task]
    first = chat(client, "combo.0", messages, [RUN_SHELL, SPAWN])
    [spawn] = first["tool_calls"]
    chat(
        client,
        "combo.0",
        [{"role": "system", "content": "[title] Write a title."}, task],
        None,
        purpose="title",
    )
    sub = [
        {"role": "system", "content": "[sub-agent] You count lines."},
        {"role": "user", "content": json.loads(spawn["function"]["arguments"])["task"]},
    ]
    answer = run_agent(client, "combo.0", sub, [RUN_SHELL])[-1]["content"]
    messages.append(
        {
            "role": "assistant",
            "content": first.get("content"),
            "reasoning": first.get("reasoning"),
            "tool_calls": first["tool_calls"],
        }
    )
    messages.append({"role": "tool", "tool_call_id": spawn["id"], "content": answer})
    run_agent(client, "combo.0", messages, [RUN_SHELL, SPAWN])
    compacted = [
        main_system,
        {
            "role": "user",
            "content": "[summary] A sub-agent counted 3 lines in notes.txt. Continue.",
        },
    ]
    run_agent(client, "combo.0", compacted, [RUN_SHELL, SPAWN])


def _stream(client: httpx.Client) -> None:
    body = {
        "model": "gpt-4.1",
        "stream": True,
        "messages": [{"role": "user", "content": "[chat] streamed hello"}],
    }
    with client.stream(
        "POST", CHAT_URL, json=body, headers={"authorization": "Bearer polar-stream.0"}
    ) as r:
        assert r.status_code == 200
        assert any(line.startswith("data: [DONE]") for line in r.iter_lines())


def produce(tmp: Path, confdir: Path) -> Session:
    server = start_policy_server(tmp, SCENARIO)
    mitm: Mitm | None = None
    try:
        mitm = start_mitm(tmp, confdir, server.url, polar_control_token=TOKEN)
        ctl = ControlClient(TOKEN, proxy=mitm.url)
        with http_client(mitm) as client:
            run_agent(
                client,
                "loop.0",
                [
                    {"role": "system", "content": "You are a coding agent. Use run_shell."},
                    {"role": "user", "content": "How many lines does notes.txt have?"},
                ],
                [RUN_SHELL],
            )
            _combo(client)
            for i in range(4):
                chat(
                    client, f"task.{i}", [{"role": "user", "content": f"[chat] attempt {i}"}], None
                )
            bad = client.post(
                CHAT_URL,
                json={"model": "gpt-4.1", "messages": "not a list"},
                headers={"authorization": "Bearer polar-bad.0"},
            )
            assert bad.status_code == 400, bad.text
            chat(client, "bad.0", [{"role": "user", "content": "[chat] after the bad one"}], None)
            _stream(client)
        for rollout, reward in LIVE_REWARDS.items():
            ctl.end(rollout, reward=reward)
        assert mitm.stop() == 0, mitm.proc.output()
        return Session(mitm.output, mitm.proc.output())
    finally:
        if mitm is not None and mitm.proc.popen.poll() is None:
            mitm.stop()
        server.stop()


if __name__ == "__main__":  # python -m tests.helpers.capture_session DIR: keep a session to look at
    import sys

    from polar_mitm.certs import ensure_ca

    root = Path(sys.argv[1]).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ensure_ca(root / "certs")
    print(produce(root, root / "certs").output)
