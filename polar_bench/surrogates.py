#!/usr/bin/env python
"""The lone-surrogate check on a request that holds surrogate escapes.

    python -m polar_bench surrogates [--messages 60] [--repeat 200]

A harness whose JSON encoder escapes non-ASCII (Python's `json.dumps` by default) sends every
emoji as a pair of surrogate escapes, so every request of such a session takes the check's slow
path (`polar_mitm.core.fastjson.lone_surrogates`, on the request hook). The request built here
is a long tool session: a system prompt, then per turn a 200-line tool output and an assistant
tool call, with an emoji and a check mark on every line. Figures: the body's size, the check's
time per request, and, beside it, what encoding the decoded value whole (`json.dumps`, the check
before 2026-12-05) costs on the same value.
"""

from __future__ import annotations

import argparse
import json
import timeit

from polar_mitm.core import fastjson


def request(messages: int) -> str:
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent. 😀 " * 20}]
    for i in range(messages):
        output = f"line {i} of output ✓ 😀\n" * 200
        msgs.append({"role": "user" if i % 3 == 0 else "tool", "content": output})
        call = {"name": "run_shell", "arguments": json.dumps({"cmd": "ls -la"})}
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": call}],
            }
        )
    tool = {"type": "function", "function": {"name": "run_shell", "parameters": {"type": "object"}}}
    return json.dumps({"model": "m", "messages": msgs, "tools": [tool] * 10})  # ASCII-only


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    text = request(args.messages)
    value = fastjson.loads(text)
    assert not fastjson.lone_surrogates(text, value)

    def whole() -> None:
        json.dumps(value, ensure_ascii=False).encode("utf-8")

    print(f"request: {len(text) / 1000:.0f} KB, surrogate escapes: {text.count(chr(92) + 'ud')}")
    for name, fn in (
        ("lone_surrogates (the walk)", lambda: fastjson.lone_surrogates(text, value)),
        ("json.dumps of the whole value", whole),
    ):
        best = min(timeit.repeat(fn, number=args.repeat, repeat=3)) / args.repeat
        print(f"{name:32s} {best * 1e3:.3f} ms per request")


if __name__ == "__main__":
    main()
