"""The real-vLLM tier's scripted logits processor, without vLLM: which reply a prompt gets.

``ScriptPlayer`` reads only the prompt's token ids (what a vLLM logits processor sees); the
reference policy server reads the request. For the same request both must pick the same turn and
produce the same ids, or the real-vLLM tests would play another conversation than the reference
server's. The processor module is loaded by path, as vLLM loads it (its package is not importable
in vLLM's venv).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import httpx
import pytest
from polar_reference import vllm_launch
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.helpers import TESTS
from tests.helpers.clients import RUN_SHELL
from tests.helpers.procs import start_policy_server
from tests.helpers.upstreams import MODEL

SCENARIOS = [TESTS / "vllm" / "scenario.json", TESTS / "e2e" / "scenarios" / "harnesses.json"]


def _tool(name: str, *params: str) -> dict:
    props = {p: {"type": "string"} for p in params}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


@pytest.fixture(scope="module")
def script():
    path = vllm_launch.SCRIPT_DIR / "vllm_script.py"
    spec = importlib.util.spec_from_file_location("vllm_script_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as Python's import does: its dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def player(script):
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    scenario = script.load_scenarios(":".join(str(s) for s in SCENARIOS))
    return script.ScriptPlayer(tokenizer, scenario)


LOOP = [
    {"role": "system", "content": "You are a coding agent. Use run_shell."},
    {"role": "user", "content": "How many lines does notes.txt have?"},
]
AFTER_ONE = [
    *LOOP,
    {
        "role": "assistant",
        "content": "",
        "reasoning": "I should look at the file first.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "run_shell", "arguments": '{"cmd": "cat notes.txt"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "alpha\nbeta\ngamma\n"},
]
CASES = {
    "loop turn 1": (0, LOOP, [RUN_SHELL], {}),
    "loop turn 2": (0, AFTER_ONE, [RUN_SHELL], {}),
    "thinking off": (0, LOOP, [RUN_SHELL], {"chat_template_kwargs": {"enable_thinking": False}}),
    # Claude Code: a second system message inside `messages`, its Bash tool among others
    "claude": (
        1,
        [
            {"role": "system", "content": "You are Claude Code.\n\n# Tools\n\nUse them well."},
            {"role": "user", "content": "Create hello.txt"},
            {"role": "system", "content": "A reminder."},
        ],
        [_tool("Read", "path"), _tool("Bash", "command", "description")],
        {},
    ),
    "codex": (
        1,
        [{"role": "user", "content": "Create hello.txt"}],
        [_tool("exec", "input")],
        {},
    ),
    "pi": (1, [{"role": "user", "content": "Create hello.txt"}], [_tool("bash", "command")], {}),
    "side call, no tools": (1, [{"role": "user", "content": "Write a title"}], None, {}),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A reference server per scenario file, for the whole module."""
    started = [start_policy_server(tmp_path_factory.mktemp("ref"), s) for s in SCENARIOS]
    yield started
    for server in started:
        server.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_player_picks_the_reference_servers_reply(player, servers, case):
    """Same request, same reply ids: the reference server's chat endpoint against the player,
    which sees only the prompt ids the server rendered."""
    index, messages, tools, extra = CASES[case]
    server = servers[index]
    body = {"model": MODEL, "messages": messages, "return_token_ids": True, "logprobs": True}
    body.update(extra)
    if tools:
        body["tools"] = tools
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert player.reply_ids(reply["prompt_token_ids"]) == reply["choices"][0]["token_ids"]


def test_no_reply_for_a_closed_turn(player):
    """A re-scoring request (a whole trace, ending with <|im_end|>) is left to the model."""
    tok = player.tokenizer
    ids = tok.apply_chat_template(
        [*LOOP, {"role": "assistant", "content": "done"}], tokenize=True, return_dict=False
    )
    assert player.reply_ids(list(ids)) is None


def test_matched_scripts_come_before_defaults(script, tmp_path):
    first = {"model": "m", "scripts": [{"name": "any", "turns": [{"content": "x"}]}]}
    second = {
        "model": "m",
        "scripts": [{"name": "hi", "match": {"user_contains": "hi"}, "turns": [{"content": "y"}]}],
    }
    paths = []
    for i, data in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(data))
    scenario = script.load_scenarios(":".join(str(p) for p in paths))
    assert [s.name for s in scenario.scripts] == ["hi", "any"]
    with pytest.raises(ValueError, match="names no scenario"):
        script.load_scenarios("")
