"""The hermes tool parser's streaming half: ``<tool_call>{json}</tool_call>`` regions as deltas.

vLLM's ``Hermes2ProToolParser.extract_tool_calls_streaming`` re-reads the whole content on every
token: where plain content ends, each region's body, whether it is complete JSON, the tool's
name, the arguments brace-matched from their start. `HermesStream` sends the same deltas (the
deltas it reproduces are described in ``qwen3.py``) but reads each character once: the content
only grows, a position that was decided stays decided, so each region keeps how far it has been
read and the state of its bracket match. Re-reading was quadratic in the reply, on the proxy's
event loop: a ``write_file`` call of 16,000 characters (3,824 tokens) took 4.2 s of CPU there
(``polar_bench/output_parser.py``).

Positions are indices into the content text the caller passes each time, which must extend the
text of the call before (`StreamParser` passes the content accumulated since ``</think>``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

_TOOL_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_TOOL_ARGS = re.compile(r'"arguments"\s*:\s*')
# What a bracket match must stop at: inside a string, its end and escapes; outside, quotes and
# the brackets of the arguments' own kind.
_IN_STRING = re.compile(r'[\\"]')
_OUTSIDE = {"{": re.compile(r'["{}]'), "[": re.compile(r'["\[\]]')}
_CLOSING = {"{": "}", "[": "]"}

Delta = dict[str, Any]


def make_tool_call_id() -> str:
    """vLLM's default tool-call id (``chatcmpl-tool-`` + a random uuid4 hex)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def partial_tag_overlap(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``tag``: such
    a suffix starts with the tag's first character, so only those few places are tried."""
    i = text.find(tag[0], max(start, len(text) - len(tag) + 1))
    while i != -1:
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


def is_complete_json(text: str) -> bool:
    """Whether `json.loads` takes `text` (a tool call's body so far). Asked on every streamed
    token of a tool call, where the answer is no until its last: a text that opens an object or
    array and ends with a character that is neither its closing bracket nor whitespace is not
    JSON (a document's last character is one of those), and is answered without `json.loads`
    raising and building its error."""
    close = _CLOSING.get(text[:1])
    if close is not None and text[-1:] != close and not text[-1:].isspace():
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(slots=True)
class _Region:
    """One ``<tool_call>`` region: where its body starts, how far it has been read."""

    body_start: int  # just past <tool_call>
    end: int | None = None  # where </tool_call> starts, once seen
    end_from: int = 0  # where to look for </tool_call> next
    lead: int | None = None  # the body's first non-whitespace character, once seen
    name: str | None = None
    args_at: int | None = None  # where the arguments' value starts, once followed by a character
    # the arguments' bracket match: read up to `scan`, at `depth`, inside a string or not,
    # after a backslash or not; `args_end` one past the closing bracket once found
    scan: int = 0
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    args_end: int | None = None
    sent_args: int = 0
    finished: bool = False  # closed, and everything it holds sent

    def body_end(self, text: str) -> int:
        """One past the body's last non-whitespace character, a partial ``</tool_call>`` at the
        end left out (it may be the closing tag coming)."""
        if self.end is not None:
            stop = self.end
        else:
            stop = len(text) - partial_tag_overlap(text, TOOL_END, self.body_start)
        lead = self.lead if self.lead is not None else self.body_start
        while stop > lead and text[stop - 1].isspace():
            stop -= 1
        return stop

    def args(self, text: str, stop: int) -> str | None:
        """The arguments' raw text so far (`_tool_args` of vLLM's parser): brace-matched when
        they are an object or array, else the rest of the body (the call's own ``}`` taken off
        once the region is closed or its body is complete JSON)."""
        if self.args_at is None:
            assert self.lead is not None
            match = _TOOL_ARGS.search(text, self.lead, stop)
            if match is None:
                return None
            if match.end() == stop:  # more whitespace may come before the value
                return ""
            self.args_at = self.scan = match.end()
        at = self.args_at
        open_ch = text[at]
        if open_ch not in _CLOSING:
            raw = text[at:stop]
            assert self.lead is not None
            if self.end is not None or is_complete_json(text[self.lead : stop]):
                raw = raw.rstrip()
                if raw.endswith("}"):
                    raw = raw[:-1].rstrip()
            return raw
        if self.args_end is None:
            self._match(text, stop, open_ch)
        return text[at : self.args_end if self.args_end is not None else stop]

    def _match(self, text: str, stop: int, open_ch: str) -> None:
        """Read the arguments up to `stop` for their closing bracket."""
        close_ch, outside = _CLOSING[open_ch], _OUTSIDE[open_ch]
        pos = self.scan
        if self.esc and pos < stop:
            self.esc, pos = False, pos + 1
        while pos < stop:
            if self.in_str:
                found = _IN_STRING.search(text, pos, stop)
                if found is None:
                    pos = stop
                    break
                pos = found.start()
                if text[pos] == "\\":
                    if pos + 1 >= stop:
                        self.esc, pos = True, stop
                        break
                    pos += 2
                    continue
                self.in_str = False
                pos += 1
                continue
            found = outside.search(text, pos, stop)
            if found is None:
                pos = stop
                break
            pos = found.start()
            c = text[pos]
            if c == '"':
                self.in_str = True
            elif c == open_ch:
                self.depth += 1
            elif c == close_ch:
                self.depth -= 1
                if self.depth == 0:
                    self.args_end = pos + 1
                    break
            pos += 1
        self.scan = pos


@dataclass
class HermesStream:
    """The deltas of one stream's tool calls, fed the whole content so far each time."""

    sent_content: int = 0
    regions: list[_Region] = field(default_factory=list)
    start_from: int = 0  # where to look for the next <tool_call>
    _seen: int = 0  # the length of the text fed last

    def _content(self, text: str) -> str | None:
        """Plain text up to the first ``<tool_call>`` (held back while the end may begin one)."""
        if self.regions:
            sendable = self.regions[0].body_start - len(TOOL_START)
        else:
            sendable = len(text) - partial_tag_overlap(text, TOOL_START)
        if sendable > self.sent_content:
            out = text[self.sent_content : sendable]
            self.sent_content = sendable
            return out
        return None

    def _find_regions(self, text: str) -> None:
        """Extend `regions` with what the text added: a closing tag, new opening tags."""
        while True:
            if self.regions and self.regions[-1].end is None:
                region = self.regions[-1]
                end = text.find(TOOL_END, region.end_from)
                if end == -1:
                    region.end_from = max(region.body_start, len(text) - len(TOOL_END) + 1)
                    return
                region.end = end
                self.start_from = end + len(TOOL_END)
            start = text.find(TOOL_START, self.start_from)
            if start == -1:
                self.start_from = max(self.start_from, len(text) - len(TOOL_START) + 1)
                return
            body_start = start + len(TOOL_START)
            self.regions.append(_Region(body_start, end_from=body_start))

    def feed(self, text: str) -> Delta | None:
        if len(text) < self._seen:
            raise ValueError("HermesStream: the content must only grow")
        self._seen = len(text)
        self._find_regions(text)
        content = self._content(text)
        calls: list[dict[str, Any]] = []
        for i, region in enumerate(self.regions):
            if region.finished:
                continue
            stop = region.body_end(text)
            if region.lead is None:
                lead = region.body_start
                while lead < stop and text[lead].isspace():
                    lead += 1
                if lead == stop:  # nothing but whitespace yet
                    break
                region.lead = lead
            if region.name is None:
                match = _TOOL_NAME.search(text, region.lead, stop)
                if not match:
                    break  # tool i+1 cannot start before tool i has its name
                region.name = match.group(1)
                calls.append(
                    {
                        "id": make_tool_call_id(),
                        "type": "function",
                        "index": i,
                        "function": {"name": region.name},
                    }
                )
            args = region.args(text, stop)
            if args is not None and len(args) > region.sent_args:
                calls.append({"index": i, "function": {"arguments": args[region.sent_args :]}})
                region.sent_args = len(args)
            region.finished = region.end is not None
        if content or calls:
            delta: Delta = {"content": content}
            if calls:
                delta["tool_calls"] = calls
            return delta
        return None
