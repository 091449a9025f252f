"""A vLLM v1 logits processor that makes a real vLLM play scripted agent turns.

Loaded by the vLLM server itself (``--logits-processors vllm_script:ScriptedReplies`` with this
directory on ``PYTHONPATH``), in vLLM's own Python 3.11 venv where polar_mitm is not installed: it
imports only the standard library, vLLM (and the transformers and torch vLLM brings), and
``scenario.py`` beside it, by path (stdlib-only, so the scenario files and their matching rules are
the reference server's own).

Only the choice of token is scripted. For every request the engine adds to its batch, the prompt
ids are decoded and read as a Qwen3-style chat rendering (``<|im_start|>role ... <|im_end|>``
blocks, tools in the system block's ``<tools>`` list, tool results as ``<tool_response>`` user
blocks); the scenario picks the script and turn exactly as the reference server does (the turn
index is the number of assistant blocks already in the prompt), the turn is rendered with the
tokenizer's chat template and tokenized, and :meth:`ScriptedReplies.apply` leaves only that
reply's next token possible at each step. Everything else stays vLLM's: chat template,
tokenizer, reasoning and tool-call parsers, streaming, id fields, logprobs (vLLM's default
``raw_logprobs`` are taken before custom processors: the model's own distribution, or the
grammar's when a request is constrained), length limits and errors.

A prompt that is not an open assistant turn (a re-scoring request, a raw completion) or that no
script matches is left alone: the model samples freely.

Scenario files come from ``POLAR_VLLM_SCENARIOS`` (paths joined with ``os.pathsep``); their
scripts are tried in order, those with a ``match`` before any default (a script without one), so
one server can play several test scenarios.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:  # the project's venv: only ScriptPlayer is used there (its unit tests)
    LogitsProcessor = object  # type: ignore[assignment,misc]

log = logging.getLogger("polar.vllm_script")

SCENARIOS_ENV = "POLAR_VLLM_SCENARIOS"
_START, _END = "<|im_start|>", "<|im_end|>"


def _scenario_module():
    """reference/polar_reference/scenario.py, loaded by path (its package is not importable here)."""
    name = "polar_vllm_scenario"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("scenario.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def load_scenarios(paths: str) -> Any:
    """One scenario of every file's scripts: matched scripts first (in file order), then defaults."""
    mod = _scenario_module()
    scripts: list[Any] = []
    model = "scripted"
    for path in filter(None, paths.split(os.pathsep)):
        scenario = mod.load_scenario(path)
        model = scenario.model
        scripts.extend(scenario.scripts)
    ordered = [s for s in scripts if s.match is not None] + [s for s in scripts if s.match is None]
    if not ordered:
        raise ValueError(f"{SCENARIOS_ENV} names no scenario file")
    return mod.Scenario(model=model, scripts=tuple(ordered), source=paths)


@dataclass(frozen=True)
class Conversation:
    """What a rendered Qwen3 prompt says, in the terms of the scenario's ``match`` keys."""

    system: str
    users: tuple[str, ...]
    tool_names: tuple[str, ...]
    assistant_turns: int
    all_text: str
    generation_prefix: str  # what the template already put in the open assistant turn


def read_prompt(text: str) -> Conversation | None:
    """Parse a decoded chat prompt; ``None`` unless it ends in an open assistant turn."""
    blocks = text.split(_START)[1:]
    if not blocks:
        return None
    role, _, open_body = blocks[-1].partition("\n")
    if role != "assistant" or _END in open_body:
        return None
    systems, users, tools, assistants, every = [], [], [], 0, []
    for block in blocks[:-1]:
        role, _, body = block.partition("\n")
        body = body.split(_END, 1)[0]
        if role == "system":
            # the template appends the tools after the first system message's text
            text, marker, tool_part = body.rpartition("\n\n# Tools\n\n")
            if not marker and body.startswith("# Tools\n\n"):
                text, tool_part = "", body
            elif not marker:
                text = body
            tools = tools or _tool_names(tool_part)
            systems.append(text)
            every.append(text)
        elif role == "user" and not body.startswith("<tool_response>"):
            users.append(body)
            every.append(body)
        elif role == "assistant":
            assistants += 1
            every.append(body)
        else:
            every.append(body)
    return Conversation(
        system="\n".join(systems),
        users=tuple(users),
        tool_names=tuple(tools),
        assistant_turns=assistants,
        all_text="\n".join(every),
        generation_prefix=open_body,
    )


def _tool_names(tool_part: str) -> list[str]:
    """Function names of the ``<tools>`` list the Qwen3 template writes (one JSON per line)."""
    inside = tool_part.partition("<tools>\n")[2].partition("\n</tools>")[0]
    names = []
    for line in inside.splitlines():
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


class ScriptPlayer:
    """Which reply a prompt gets: the scenario's turn, rendered and tokenized."""

    def __init__(self, tokenizer: Any, scenario: Any) -> None:
        self.tokenizer = tokenizer
        self.scenario = scenario
        self.eos = tokenizer.convert_tokens_to_ids(_END)
        self._probe = tokenizer.apply_chat_template(
            [{"role": "user", "content": "."}], add_generation_prompt=True, tokenize=False
        )

    def reply_ids(self, prompt_ids: list[int]) -> list[int] | None:
        """The scripted reply's token ids for this prompt, ending with ``<|im_end|>``; ``None``
        when the prompt is not an open assistant turn or no script matches it."""
        conv = read_prompt(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        if conv is None:
            return None
        try:
            _, turn = self.scenario.turn(
                conv.system,
                conv.users[0] if conv.users else "",
                conv.tool_names,
                conv.assistant_turns,
                conv.users[-1] if conv.users else "",
                conv.all_text,
            )
        except LookupError:
            return None
        text = self.render(turn, with_reasoning=not conv.generation_prefix)
        if conv.generation_prefix and text.startswith(conv.generation_prefix):
            text = text[len(conv.generation_prefix) :]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids[: ids.index(self.eos) + 1] if self.eos in ids else [*ids, self.eos]

    def render(self, turn: Any, with_reasoning: bool) -> str:
        """The assistant turn as the chat template writes it after a generation prompt."""
        message = _scenario_module().assistant_message(turn, with_reasoning)
        full = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "."}, message], tokenize=False
        )
        return full[len(self._probe) :] if full.startswith(self._probe) else full


class ScriptedReplies(LogitsProcessor):
    """Forces each request's scripted reply, one token per step (see the module docstring)."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        scenario = load_scenarios(os.environ.get(SCENARIOS_ENV, ""))
        self.player = ScriptPlayer(tokenizer, scenario)
        # batch index -> [the reply's ids, the request's live output ids, reply tokens skipped]
        self.forced: dict[int, list[Any]] = {}
        log.info("scripted replies: %d scripts from %s", len(scenario.scripts), scenario.source)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._new_request)

    def _new_request(self, params, prompt_ids, output_ids) -> list[Any] | None:
        if not prompt_ids:
            return None
        try:
            reply = self.player.reply_ids(prompt_ids)
        except Exception:  # a script that cannot be rendered: let the model sample, say why
            log.exception("scripted replies: no reply for a %d-token prompt", len(prompt_ids))
            return None
        return [reply, output_ids, 0] if reply else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Leave only the reply's next token. A token the request's grammar forbids (its
        bitmask is applied before custom processors: the logit is already -inf) is skipped,
        e.g. the template's "\\n\\n" before ``<tool_call>`` under ``tool_choice: required``;
        when no later reply token is allowed either, the model samples under the grammar."""
        for index, state in self.forced.items():
            reply, output, skipped = state
            step = len(output) + skipped
            if index >= logits.shape[0] or step >= len(reply):
                continue
            row = logits[index]
            while step < len(reply) and row[reply[step]].item() == float("-inf"):
                step += 1
            if step >= len(reply):
                continue
            state[2] = step - len(output)
            row.fill_(float("-inf"))
            row[reply[step]] = 0.0
        return logits
