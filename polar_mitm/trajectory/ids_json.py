"""The JSON text of exact-prefix chains' token ids, kept for the next call that extends them.

A token-in request carries the whole prompt as a JSON list of ids, and almost all of it is the
chain the call extends: 80k ids late in a long agent session. Writing that text again from the
chain's int32 array every call (a Python int per id, then msgspec) was 1.2-2.2 ms a call at 81k
ids; the previous call's request already held it. So the text of each chain's ids (its prompt's
text as sent, then its output) is kept, and a call sends ``[`` + that + ``,`` + its new ids +
``]``. It is a cache, not state: least recently used chains go first past `BUDGET` bytes (6.5 B
a token), and a chain without its text gets it written once from its array.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..core import fastjson

BUDGET = 64 << 20  # bytes of id text kept in all (about 10M tokens)


def ids_text(ids: Sequence[int]) -> bytes:
    """``1,2,3``: the ids as the inside of a JSON list."""
    values = ids.tolist() if isinstance(ids, array) else list(ids)
    return fastjson.dumps_bytes(values)[1:-1]


def joined(*parts: bytes | memoryview) -> bytes:
    """The JSON list of the ids in these texts (each as `ids_text` writes them). One copy of
    the parts (a chain's text is 400 KB at 60k ids): not ``b"[" + ... + b"]"``, which copies it
    three times."""
    return b"".join([b"[", b",".join([p for p in parts if len(p)]), b"]"])


def inner(*parts: bytes | memoryview) -> bytes:
    """The ids of these texts as one text (the inside of `joined`'s list), in one copy."""
    return b",".join([p for p in parts if len(p)])


class IdsJson:
    """Chain key (its last call's id) -> the text of its ids; thread-safe (plans run in
    worker threads, chains are remembered on the event loop)."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget = budget
        self._texts: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def of(self, key: str, ids: array) -> bytes:
        """The text of a chain's ids: kept, or written from `ids` (and kept)."""
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        text = ids_text(ids)
        self.put(key, text)
        return text

    def put(self, key: str, text: bytes) -> None:
        with self._lock:
            old = self._texts.pop(key, None)
            self._size -= len(old) if old is not None else 0
            if len(text) > self.budget:
                return
            self._texts[key] = text
            self._size += len(text)
            while self._size > self.budget:
                _, dropped = self._texts.popitem(last=False)
                self._size -= len(dropped)

    def drop(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                text = self._texts.pop(key, None)
                self._size -= len(text) if text is not None else 0

    @property
    def size(self) -> int:
        return self._size
