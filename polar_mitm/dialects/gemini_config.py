"""Google Gemini requests, the settings half: tools, tool config, generation config, schemas.

`google_gemini` reads the conversation (`contents`) and writes the replies; this module turns
the rest of a `GenerateContentRequest` into chat-completions fields, and holds the field access
both share: proto JSON names or the snake_case ones Google's REST examples use, a repeated field
given as one object. What maps to what is in docs/dialects.md, "Google Gemini".
"""

from __future__ import annotations

import functools
import re
from typing import Any

from .base import DialectError, is_a
from .convert import function_tool, number, positive_int

# fmt: off
# Google's tools: each runs on Google's servers, which nothing behind polar-mitm replaces.
_SERVER_TOOLS = (
    "googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext", "computerUse",
    "fileSearch", "googleMaps", "retrieval", "enterpriseWebSearch",
)
# generationConfig -> chat (`top_k`: vLLM's and SGLang's sampling extension), and the ranges.
_SAMPLING = {
    "maxOutputTokens": "max_tokens", "temperature": "temperature", "topP": "top_p",
    "topK": "top_k", "presencePenalty": "presence_penalty",
    "frequencyPenalty": "frequency_penalty", "seed": "seed",
}
_RANGES = {
    "temperature": (0.0, 2.0), "topP": (0.0, 1.0), "presencePenalty": (-2.0, 2.0),
    "frequencyPenalty": (-2.0, 2.0),
}
# The generationConfig fields read (each in its two spellings); others are noted as ignored.
_CONFIG_KEYS = (
    *_SAMPLING, "candidateCount", "stopSequences", "responseModalities", "responseMimeType",
    "responseJsonSchema", "responseSchema", "responseLogprobs", "logprobs", "thinkingConfig",
)
# fmt: on


@functools.cache
def snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def get_field(obj: dict[str, Any], name: str) -> Any:
    """A field by its proto JSON name, or the snake_case one Google's REST examples use."""
    value = obj.get(name)
    return value if value is not None else obj.get(snake(name))


def repeated(value: Any, where: str) -> list[Any]:
    """A repeated field; Google also takes a single object for one element."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [value]
    if not isinstance(value, list):
        raise DialectError(f"'{where}' must be a list")
    return value


def function_tools(raw: Any) -> list[dict[str, Any]]:
    tools = []
    for i, tool in enumerate(repeated(raw, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise DialectError(f"{where} must be an object")
        for key in _SERVER_TOOLS:
            if get_field(tool, key) is not None:
                raise DialectError(
                    f"{where}: Google tool {key!r} is not supported: nothing behind polar-mitm "
                    "can run it"
                )
        declarations = repeated(
            get_field(tool, "functionDeclarations"), f"{where}.functionDeclarations"
        )
        for j, decl in enumerate(declarations):
            tools.append(_declaration(decl, f"{where}.functionDeclarations[{j}]"))
    return tools


def _declaration(decl: Any, where: str) -> dict[str, Any]:
    if not isinstance(decl, dict):
        raise DialectError(f"{where} must be an object")
    name = decl.get("name")
    if not isinstance(name, str) or not name:
        raise DialectError(f"{where} needs a string 'name'")
    schema = get_field(decl, "parametersJsonSchema")
    if schema is None and get_field(decl, "parameters") is not None:
        schema = json_schema(get_field(decl, "parameters"))
    if schema is not None and not isinstance(schema, dict):
        raise DialectError(f"{where}: the parameters must be an object")
    description = decl.get("description")
    return function_tool(name, description if isinstance(description, str) else None, schema)


def json_schema(schema: Any) -> Any:
    """Google's OpenAPI-subset Schema as JSON Schema: its enum-style upper-case `type` names
    (`OBJECT`, `STRING`, ...) lowered, in nested properties, items and anyOf too; every other
    keyword kept as it is."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: json_schema(s) for name, s in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = json_schema(value)
        else:
            out[key] = value
    return out


# Keywords whose value is a schema (or a list of them), and those that map names to schemas.
_SCHEMA_VALUES = frozenset(
    {"items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not"}
)
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})


def tool_choice(config: Any, notes: list[str]) -> Any:
    if config is None:
        return None
    calling = get_field(config, "functionCallingConfig") if isinstance(config, dict) else None
    if calling is None:
        return None
    if not isinstance(calling, dict):
        raise DialectError("'toolConfig.functionCallingConfig' must be an object")
    mode = str(calling.get("mode") or "AUTO").upper()
    allowed = get_field(calling, "allowedFunctionNames") or []
    if mode in ("AUTO", "MODE_UNSPECIFIED"):
        return "auto"
    if mode == "NONE":
        return "none"
    if mode == "VALIDATED":
        notes.append("toolConfig mode VALIDATED sent as auto")
        return "auto"
    if mode == "ANY":
        if isinstance(allowed, list) and len(allowed) == 1 and isinstance(allowed[0], str):
            return {"type": "function", "function": {"name": allowed[0]}}
        if allowed:
            notes.append("toolConfig allowedFunctionNames not enforced (required: any tool)")
        return "required"
    raise DialectError(f"'toolConfig.functionCallingConfig.mode' {mode!r} is not supported")


def generation(
    config: dict[str, Any], chat: dict[str, Any], notes: list[str], counting: bool
) -> bool:
    """generationConfig into the chat body; whether the client asked to see the thoughts."""
    known = {*_CONFIG_KEYS, *map(snake, _CONFIG_KEYS)}
    notes.extend(f"ignored generationConfig.{key}" for key in config if key not in known)
    config = {
        k: v for k, v in ((key, get_field(config, key)) for key in _CONFIG_KEYS) if v is not None
    }
    for key, target in _SAMPLING.items():
        if key in _RANGES:
            value = number(config, key, *_RANGES[key])
        elif key == "seed":
            value = config.get(key)
            if value is not None and not is_a(value, int):
                raise DialectError("'seed' must be an integer")
        else:
            value = positive_int(config, key)
        if value is not None and not (counting and key == "maxOutputTokens"):
            chat[target] = value
    if config.get("candidateCount") not in (None, 1):
        raise DialectError("polar-mitm captures one sample per call: 'candidateCount' must be 1")
    stops = config.get("stopSequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise DialectError("'stopSequences' must be a list of strings")
        chat["stop"] = stops
    modalities = config.get("responseModalities") or []
    if not isinstance(modalities, list) or any(str(m).upper() != "TEXT" for m in modalities):
        raise DialectError("'responseModalities' must be TEXT: the policy writes text only")
    fmt = _response_format(config)
    if fmt is not None:
        chat["response_format"] = fmt
    if config.get("responseLogprobs") or config.get("logprobs"):
        notes.append("responseLogprobs not returned (the record has the logprobs)")
    thinking = config.get("thinkingConfig") or {}
    if not isinstance(thinking, dict):
        raise DialectError("'thinkingConfig' must be an object")
    kwargs: dict[str, Any] = {}
    budget = get_field(thinking, "thinkingBudget")
    level = get_field(thinking, "thinkingLevel")
    if budget is not None:
        if not is_a(budget, int):
            raise DialectError("'thinkingConfig.thinkingBudget' must be an integer")
        kwargs["enable_thinking"] = budget != 0
    if isinstance(level, str) and level.upper() != "THINKING_LEVEL_UNSPECIFIED":
        kwargs["reasoning_effort"] = level.lower()
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return bool(get_field(thinking, "includeThoughts"))


def _response_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """JSON output: `responseMimeType: application/json` with an optional schema."""
    mime = config.get("responseMimeType")
    schema = config.get("responseJsonSchema")
    if schema is None:
        schema = config.get("responseSchema")
    # Gemini CLI writes Google's upper-case type names in its responseJsonSchema too, which no
    # server's JSON-schema decoding takes; lowering them changes nothing in a valid schema.
    schema = json_schema(schema)
    if mime in (None, "text/plain") and schema is None:
        return None
    if mime not in (None, "application/json"):
        raise DialectError(f"'responseMimeType' {mime!r} is not supported (text/plain or JSON)")
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise DialectError("'responseJsonSchema' must be an object")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
