"""Scenario files: the scripted conversations the reference policy server plays.

A scenario is JSON::

    {"model": "Qwen/Qwen3-4B",
     "scripts": [
       {"name": "main",
        "match": {"system_contains": "...", "user_contains": "...", "tools_include": "run_shell",
                  "last_user_contains": "...", "text_contains": "..."},
        "turns": [{"reasoning": "...", "content": "...",
                   "tool_calls": [{"name": "run_shell", "arguments": {"cmd": "ls"}}]},
                  {"content": "done"}]}]}

The server is stateless on purpose: the script is chosen from the request itself (first script whose
``match`` keys all hold; a script without ``match`` matches anything) and the turn index is the number
of assistant messages already in the request. ``user_contains`` looks at the first user message,
``last_user_contains`` at the last one, ``text_contains`` at every message (what tells a long
session's steps apart once a compaction has replaced its history). Concurrent rollouts therefore never interfere, and a
retried request gets the same answer.

Per-turn knobs: ``hold_last`` (send every chunk before the one with ``finish_reason``, then wait for
``POST /_polar/release``, at most 30 s; a non-streaming reply is held whole), ``delay_s`` (sleep before the first chunk), ``finish_reason`` (override the
reported reason) and ``fault`` (reserved for fault modes, see ``faults.py``). Unknown keys are kept in
``Turn.extra`` and otherwise ignored, so newer scenario files still load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

#: The reply once a conversation has more assistant turns than its script.
PAST_END_TEXT = "The scripted conversation has ended."

_TURN_KEYS = {
    "reasoning",
    "content",
    "tool_calls",
    "hold_last",
    "delay_s",
    "finish_reason",
    "fault",
}
_MATCH_KEYS = {
    "system_contains",
    "user_contains",
    "tools_include",
    "last_user_contains",
    "text_contains",
}


class ScenarioError(ValueError):
    """A scenario file is malformed; the message names the offending place."""


@dataclass(frozen=True)
class ToolCallSpec:
    """One scripted tool call. ``arguments`` is what the model "writes" (a JSON object, usually)."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class Turn:
    """One scripted assistant turn and its delivery knobs."""

    reasoning: str | None = None
    content: str = ""
    tool_calls: tuple[ToolCallSpec, ...] = ()
    hold_last: bool = False
    delay_s: float = 0.0
    finish_reason: str | None = None
    fault: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Match:
    """Conditions a request must meet for a script to apply. ``None`` means "don't care"."""

    system_contains: str | None = None
    user_contains: str | None = None
    tools_include: str | None = None
    last_user_contains: str | None = None
    text_contains: str | None = None

    def holds(
        self,
        system_text: str,
        first_user_text: str,
        tool_names: Sequence[str],
        last_user_text: str = "",
        all_text: str = "",
    ) -> bool:
        wanted = (
            (self.system_contains, system_text),
            (self.user_contains, first_user_text),
            (self.last_user_contains, last_user_text),
            (self.text_contains, all_text),
        )
        if any(needle is not None and needle not in text for needle, text in wanted):
            return False
        return self.tools_include is None or self.tools_include in tool_names


@dataclass(frozen=True)
class Script:
    name: str
    match: Match | None
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Scenario:
    model: str
    scripts: tuple[Script, ...]
    source: str = "<memory>"

    def select(
        self,
        system_text: str,
        first_user_text: str,
        tool_names: Sequence[str],
        last_user_text: str = "",
        all_text: str = "",
    ) -> Script:
        """First script whose match holds; scripts without ``match`` are defaults."""
        for script in self.scripts:
            if script.match is None or script.match.holds(
                system_text, first_user_text, tool_names, last_user_text, all_text
            ):
                return script
        raise LookupError(f"no script in {self.source} matches this request")

    def turn(
        self,
        system_text: str,
        first_user_text: str,
        tool_names: Sequence[str],
        assistant_turns: int,
        last_user_text: str = "",
        all_text: str = "",
    ) -> tuple[Script, Turn]:
        """The script and turn for a request that already holds ``assistant_turns`` assistant messages."""
        script = self.select(system_text, first_user_text, tool_names, last_user_text, all_text)
        if assistant_turns < len(script.turns):
            return script, script.turns[assistant_turns]
        return script, Turn(content=PAST_END_TEXT)


def assistant_message(turn: Turn, with_reasoning: bool = True) -> dict[str, Any]:
    """The chat message a scripted turn is, as a chat template takes it (reasoning as
    ``reasoning_content``, tool-call arguments as objects): what the reference server and the real
    vLLM's scripted logits processor (``vllm_script.py``) both render to get a turn's tokens."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if with_reasoning and turn.reasoning is not None:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    return message


def _parse_tool_call(raw: Any, where: str) -> ToolCallSpec:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise ScenarioError(f"{where}: a tool call needs a string 'name'")
    arguments = raw.get("arguments", {})
    if isinstance(arguments, str):
        # Scenario authors may paste the wire form; the model writes the object.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCallSpec(name=raw["name"], arguments=arguments)


def _parse_turn(raw: Any, where: str) -> Turn:
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{where}: a turn must be an object")
    reasoning = raw.get("reasoning")
    content = raw.get("content") or ""
    if reasoning is not None and not isinstance(reasoning, str):
        raise ScenarioError(f"{where}: 'reasoning' must be a string")
    if not isinstance(content, str):
        raise ScenarioError(f"{where}: 'content' must be a string")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ScenarioError(f"{where}: 'tool_calls' must be a list")
    finish_reason = raw.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise ScenarioError(f"{where}: 'finish_reason' must be a string")
    try:
        delay_s = float(raw.get("delay_s") or 0.0)
    except (TypeError, ValueError):
        raise ScenarioError(f"{where}: 'delay_s' must be a number") from None
    return Turn(
        reasoning=reasoning,
        content=content,
        tool_calls=tuple(
            _parse_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ),
        hold_last=bool(raw.get("hold_last", False)),
        delay_s=delay_s,
        finish_reason=finish_reason,
        fault=raw.get("fault"),
        extra={k: v for k, v in raw.items() if k not in _TURN_KEYS},
    )


def _parse_match(raw: Any, where: str) -> Match | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ScenarioError(f"{where}: 'match' must be an object")
    unknown = set(raw) - _MATCH_KEYS
    if unknown:
        raise ScenarioError(f"{where}: unknown match keys {sorted(unknown)}")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise ScenarioError(f"{where}.{key}: must be a string")
    return Match(**raw)


def parse_scenario(data: Any, source: str = "<memory>") -> Scenario:
    """Build a :class:`Scenario` from decoded JSON, with errors that name the bad field."""
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: the scenario must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ScenarioError(f"{source}: 'model' must be a non-empty string")
    raw_scripts = data.get("scripts")
    if not isinstance(raw_scripts, list) or not raw_scripts:
        raise ScenarioError(f"{source}: 'scripts' must be a non-empty list")
    scripts = []
    for i, raw in enumerate(raw_scripts):
        where = f"{source}: scripts[{i}]"
        if not isinstance(raw, Mapping):
            raise ScenarioError(f"{where}: must be an object")
        turns = raw.get("turns")
        if not isinstance(turns, list) or not turns:
            raise ScenarioError(f"{where}: 'turns' must be a non-empty list")
        scripts.append(
            Script(
                name=str(raw.get("name") or f"script{i}"),
                match=_parse_match(raw.get("match"), where),
                turns=tuple(_parse_turn(t, f"{where}.turns[{j}]") for j, t in enumerate(turns)),
            )
        )
    return Scenario(model=model, scripts=tuple(scripts), source=source)


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file; a bad file raises :class:`ScenarioError` with one readable line."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ScenarioError(f"cannot read scenario {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}: not valid JSON ({e})") from None
    return parse_scenario(data, source=str(path))


def bundled_scenario(name: str) -> Path:
    """Path of a scenario shipped in ``reference/polar_reference/scenarios/`` (``"demo"``, ``"tool_loop"``)."""
    path = Path(str(resources.files(__package__) / "scenarios" / f"{name}.json"))
    if not path.is_file():
        raise ScenarioError(f"no bundled scenario named {name!r}")
    return path


def demo_scenario_path() -> Path:
    return bundled_scenario("demo")
