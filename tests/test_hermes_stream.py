"""`HermesStream` reads each character once and sends what re-reading the whole content sends.

The oracle below is the parser as it was before it became incremental: on every call it re-reads
the whole content the way vLLM's ``Hermes2ProToolParser.extract_tool_calls_streaming`` does
(where plain content ends, every region's stripped body, its JSON completeness, the name, the
arguments brace-matched from their start). Both are fed the same contents, cut into chunks at
every position and in random groups, and must send the same deltas (tool-call ids aside: they
are random).
"""

from __future__ import annotations

import json
import random
import re

import pytest

from polar_mitm.output_parsers.hermes_stream import (
    HermesStream,
    is_complete_json,
    partial_tag_overlap,
)

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


def _overlap(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _args(body: str, complete: bool) -> str | None:
    match = _ARGS.search(body)
    if not match:
        return None
    raw = body[match.end() :]
    if not raw or raw[0] not in "{[":
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw
    open_ch, close_ch = raw[0], "}" if raw[0] == "{" else "]"
    depth, in_str, esc = 0, False, False
    for i, c in enumerate(raw):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return raw[: i + 1]
    return raw


def _regions(text: str) -> list[tuple[str, bool]]:
    regions, pos = [], 0
    while True:
        start = text.find(TOOL_START, pos)
        if start == -1:
            return regions
        body_start = start + len(TOOL_START)
        end = text.find(TOOL_END, body_start)
        if end != -1:
            regions.append((text[body_start:end].strip(), True))
            pos = end + len(TOOL_END)
            continue
        raw = text[body_start:]
        overlap = _overlap(raw, TOOL_END)
        if overlap:
            raw = raw[:-overlap]
        body = raw.strip()
        regions.append((body, is_complete_json(body) if body else False))
        return regions


class Rereading:
    """The oracle: every call re-reads the whole content."""

    def __init__(self) -> None:
        self.sent_content = 0
        self.names: list[str | None] = []
        self.sent_args: list[str] = []

    def feed(self, text: str) -> dict | None:
        sendable = (
            text.index(TOOL_START) if TOOL_START in text else len(text) - _overlap(text, TOOL_START)
        )
        content = None
        if sendable > self.sent_content:
            content, self.sent_content = text[self.sent_content : sendable], sendable
        calls: list[dict] = []
        for i, (body, complete) in enumerate(_regions(text)):
            if i >= len(self.names):
                self.names.append(None)
                self.sent_args.append("")
            if self.names[i] is None:
                match = _NAME.search(body)
                if not match:
                    break
                self.names[i] = match.group(1)
                calls.append(
                    {"id": "X", "type": "function", "index": i, "function": {"name": match[1]}}
                )
            args = _args(body, complete)
            if args is not None and len(args) > len(self.sent_args[i]):
                calls.append(
                    {"index": i, "function": {"arguments": args[len(self.sent_args[i]) :]}}
                )
                self.sent_args[i] = args
        if content or calls:
            return {"content": content, **({"tool_calls": calls} if calls else {})}
        return None


def _call(name: str, args: object, *, spaced: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": args}, indent=2 if spaced else None)
    return f"{TOOL_START}\n{body}\n{TOOL_END}"


CONTENTS = [
    "Just text, no tools at all.",
    "Text that ends in a partial tag <tool_c",
    "Before. " + _call("run", {"cmd": 'echo "}{" \\ done', "n": [1, [2, {"a": None}]]}),
    "\n\n" + _call("a", {}) + "\n" + _call("b", {"x": "]]"}, spaced=True),
    _call("write", {"path": "a.py", "content": 'def f():\n    return {"k": [1, 2]}\n' * 5}),
    _call("arr", [1, "two", {"three": 3}]),
    TOOL_START + '{"name": "s", "arguments": "a plain \\"string\\" value"}' + TOOL_END,
    TOOL_START + '{"name": "n", "arguments": 42   }' + TOOL_END,
    "x" + TOOL_START + '{"name": "n", "arguments": 7 } }' + TOOL_END,  # closed, not JSON
    TOOL_START + '{"arguments": {"name": "inner"}, "name": "outer"}' + TOOL_END,
    TOOL_START + '{"name": "bad", "arguments": {"unclosed": [1, 2}' + TOOL_END + " trailing",
    TOOL_START + '{"arguments": {"no": "name"}}' + TOOL_END + _call("never", {}),
    TOOL_START + "   " + TOOL_END + _call("after_empty", {"a": 1}),
    TOOL_START + '{"name": "cut", "arguments": {"text": "not closed yet \\',
    TOOL_START + '{"name": "fake", "arguments": {"t": "</tool_cx"}}' + TOOL_END,
    TOOL_START + '{"name"  :  "ws",   "arguments"   :   \n  {"a": "b"}  }' + TOOL_END,
    "Text </tool_call> first, then " + _call("late", {"k": "v"}),
]


def _feed_all(parser, text: str, cuts: list[int]) -> list[dict | None]:
    out = []
    for cut in [*cuts, len(text)]:
        delta = parser.feed(text[:cut])
        for call in (delta or {}).get("tool_calls", ()):
            if "id" in call:
                assert call["id"].startswith("chatcmpl-tool-") or call["id"] == "X"
                call["id"] = "X"
        out.append(delta)
    return out


@pytest.mark.parametrize("text", CONTENTS, ids=range(len(CONTENTS)))
def test_incremental_deltas_equal_rereading_ones(text):
    rng = random.Random(len(text))
    splits = [list(range(1, len(text)))]  # a character a call
    splits += [[k] for k in range(1, len(text))]  # two calls, cut anywhere
    for _ in range(30):
        k = rng.randint(1, max(1, len(text) // 3))
        splits.append(sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1))))
    for cuts in splits:
        assert _feed_all(HermesStream(), text, cuts) == _feed_all(Rereading(), text, cuts), cuts


def test_content_that_shrinks_is_refused():
    stream = HermesStream()
    stream.feed("some text")
    with pytest.raises(ValueError, match="only grow"):
        stream.feed("some")


def test_partial_tag_overlap_is_the_longest_suffix_that_starts_the_tag():
    rng = random.Random(3)
    for _ in range(3000):
        text = "".join(rng.choice("<</tool_call>x ") for _ in range(rng.randint(0, 16)))
        for tag in (TOOL_START, TOOL_END):
            start = rng.randint(0, len(text))
            assert partial_tag_overlap(text, tag, start) == _overlap(text[start:], tag), text
