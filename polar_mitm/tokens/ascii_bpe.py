"""The Hugging Face tokenizer's own ids for plain-ASCII text, without its slow pre-tokenizer.

Exact-prefix mode tokenizes each call's new messages (a 6k-character tool result late in a long
agent session). With Qwen's tokenizer, 2.1 of the 2.3 ms that takes is the pre-tokenizer: the
Split regex run by Oniguruma. The BPE itself is fast. `AsciiEncoder` pre-tokenizes with Python's
`re` instead and hands every piece to the same tokenizer's own BPE model (`model.tokenize`), so
the merges are the tokenizer's own, not a re-implementation (such as tiktoken's ranks); pieces seen
before come from a cache. 0.45 ms for that tool result, the same ids.

It is used only where it is the same function as ``backend.encode(text, add_special_tokens=False)``,
and `build` checks each condition on the tokenizer's own definition (``tokenizer.json``), else
returns None (the tokenizer is then used as it is):

1. Added tokens. The pipeline first cuts the text at every added token (leftmost-longest), each
   becoming its id. Here: the same, from the tokenizer's own added-token list, with one regex of
   their texts longest first (leftmost-first over alternatives sorted longest first is
   leftmost-longest). Only when every added token has ``normalized``, ``lstrip``, ``rstrip`` and
   ``single_word`` false (they are matched on the raw text, as-is).
2. Normalizer: none, or NFC. NFC leaves ASCII text as it is (no ASCII character has a canonical
   decomposition, and every canonical composition involves a non-ASCII character), and `encode`
   takes only text of `DOMAIN`, a subset of ASCII.
3. Pre-tokenizer: exactly ``Sequence[Split(P, Isolated), ByteLevel(use_regex=false,
   add_prefix_space=false)]``, with P one of the patterns of `PATTERNS` (Qwen2/Qwen3's and
   Qwen3.5's). Each such P is given here with each class spelled out as its members within
   `DOMAIN`: ``\\p{L}`` as ``[A-Za-z]``, ``\\p{N}`` as ``[0-9]``, ``\\p{M}`` as nothing, ``\\s`` as
   ``[\\t\\n\\r ]`` (the only whitespace characters in `DOMAIN`: vertical tab, form feed and the
   other control characters are kept out of it, as engines disagree on some of them), ``\\S`` as
   its complement. On text of `DOMAIN` each class matches the same characters as the original, and
   the pattern has no construct on which Oniguruma and Python's `re` differ (alternation is
   leftmost-first and quantifiers greedy with backtracking in both; ``(?i:...)`` covers only ASCII
   letters and the apostrophe here; ``(?!...)`` is a plain negative lookahead), so both find the
   same matches. Every character of `DOMAIN` is covered by some alternative, so there are no
   unmatched gaps (`_pieces` keeps any as pieces all the same, as ``Isolated`` does). The
   ByteLevel step maps each byte to a character (GPT-2's table); `build` checks the table here
   against the tokenizer's own ByteLevel pre-tokenizer for every character of `DOMAIN`.
4. Model: BPE without dropout; each piece, mapped, goes to the tokenizer's own ``model.tokenize``,
   the call the pipeline makes per piece.
5. Post-processor: none or ByteLevel (offsets only); ``add_special_tokens=False`` adds nothing.

`tests/test_ascii_bpe.py` checks the split against the tokenizer's own pre-tokenizer on every
string up to length 5 over an alphabet with a member of every class the pattern tells apart, and
whole encodings against ``backend.encode`` on random texts with added tokens in them.
"""

from __future__ import annotations

import json
import re
from typing import Any

# The characters `AsciiEncoder.encode` takes: tab, newline, carriage return and printable ASCII.
DOMAIN = re.compile(r"[^\t\n\r\x20-\x7e]")  # a match: the text is outside the domain

# Pre-tokenizer patterns (as tokenizer.json spells them) -> the same pattern with each class
# spelled out as its members within DOMAIN.
_S = r"[\t\n\r ]"  # \s
_NS = r"[^\t\n\r ]"  # \S
PATTERNS = {
    # Qwen2, Qwen2.5, Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        rf"| ?[^\t\n\r A-Za-z0-9]+[\r\n]*|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+"
    ),
    # Qwen3.5, Qwen3.6 (\p{M}: no ASCII character is a mark)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        rf"| ?[^\t\n\r A-Za-z0-9]+[\r\n]*|{_S}*[\r\n]+|{_S}+(?!{_NS})|{_S}+"
    ),
}
# Pieces -> ids kept, then the cache starts over: 174 B an entry (this repository's code and
# docs as tool output), at most about 6 MB.
CACHE_ENTRIES = 1 << 15


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte -> character table (ByteLevel), for the bytes of DOMAIN."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return {b: table[b] for b in range(128)}


def _state(part: Any) -> dict[str, Any] | None:
    """A tokenizer part's definition (its tokenizer.json entry); None for no part."""
    return None if part is None else json.loads(part.__getstate__())


class AsciiEncoder:
    """``backend.encode(text, add_special_tokens=False).ids`` for text of DOMAIN (see above)."""

    def __init__(
        self, backend: Any, split: re.Pattern[str], added: dict[str, int], table: dict[int, str]
    ) -> None:
        self._model = backend.model
        self._split = split
        self._added = added
        self._added_re = (
            re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
            if added
            else None
        )
        self._table = str.maketrans(table)
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def build(cls, backend: Any) -> AsciiEncoder | None:
        """The encoder for a `tokenizers.Tokenizer`, or None where it would not be the same
        function (any condition of the module's list unmet)."""
        # Each part's own definition, not `backend.to_str()`: that is the whole vocabulary and
        # merges as JSON (tens of MB in Python objects for a moment, the proxy's peak RSS).
        try:
            normalizer = _state(backend.normalizer) or {"type": "NFC"}
            pre = _state(backend.pre_tokenizer) or {}
            post = _state(backend.post_processor)
            model = backend.model
            added_tokens = list(backend.get_added_tokens_decoder().items())
            truncation, padding = backend.truncation, backend.padding
        except Exception:
            return None
        if normalizer.get("type") != "NFC" or truncation is not None or padding is not None:
            return None
        if post is not None and post.get("type") != "ByteLevel":
            return None
        if type(model).__name__ != "BPE" or getattr(model, "dropout", None) not in (None, 0, 0.0):
            return None
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return None
        split, level = steps
        pattern = (split.get("pattern") or {}).get("Regex")
        if (
            split.get("type") != "Split"
            or split.get("behavior") != "Isolated"
            or split.get("invert")
            or pattern not in PATTERNS
            or level.get("type") != "ByteLevel"
            or level.get("use_regex")
            or level.get("add_prefix_space")
        ):
            return None
        added: dict[str, int] = {}
        for i, token in added_tokens:
            if token.normalized or token.lstrip or token.rstrip or token.single_word:
                return None
            if not token.content:
                return None
            added[token.content] = int(i)
        table = _byte_level_map()
        try:
            from tokenizers import pre_tokenizers
        except ImportError:
            return None
        level_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        for b in range(128):
            c = chr(b)
            if DOMAIN.search(c):
                continue
            if level_tok.pre_tokenize_str(c) != [(table[b], (0, 1))]:
                return None
        return cls(backend, re.compile(PATTERNS[pattern]), added, table)

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text`, or None when it is not all of DOMAIN (then use the tokenizer)."""
        if DOMAIN.search(text):
            return None
        out: list[int] = []
        if self._added_re is None:
            self._pieces(text, out)
            return out
        pos = 0
        for m in self._added_re.finditer(text):
            if m.start() > pos:
                self._pieces(text[pos : m.start()], out)
            out.append(self._added[m.group()])
            pos = m.end()
        if pos < len(text):
            self._pieces(text[pos:], out)
        return out

    def pieces(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces of `text` (no added tokens in it), before ByteLevel."""
        found: list[str] = []
        pos = 0
        for m in self._split.finditer(text):
            if m.start() > pos:
                found.append(text[pos : m.start()])  # a gap is a piece too (Isolated)
            found.append(m.group())
            pos = m.end()
        if pos < len(text):
            found.append(text[pos:])
        return found

    def _pieces(self, text: str, out: list[int]) -> None:
        cache = self._cache
        found = self._split.findall(text)
        if sum(map(len, found)) != len(text):  # a gap (none on DOMAIN, see above): keep it
            found = self.pieces(text)
        for piece in found:
            ids = cache.get(piece)
            if ids is None:
                ids = tuple(t.id for t in self._model.tokenize(piece.translate(self._table)))
                if len(cache) >= CACHE_ENTRIES:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)
