"""The write-ahead journal: where a captured row becomes durable before any Parquet exists.

A row is "captured" once its record is in a segment file and the file is fsynced. Parquet shards are
built later from the journaled rows; the journal is trimmed only after the shards are durable, so a
crash at any point loses at most rows that were never fsynced (and `Store.sync()` says which).

On-disk format, chosen to be trivially recoverable:

- ``<journal_dir>/seg-<n:08d>.log``: append-only segment files, ``n`` increasing, never reused while
  the manifest mentions it. A segment is written by one thread and closed ("rotated") before its rows
  are turned into shards, so a closed segment never changes again.
- Each record is ``[u32 length][u32 crc32(payload)][payload]`` (little-endian), payload = msgpack of
  ``{"d": dataset, "r": row}``. Because files are append-only, damage can only be a torn *tail*
  (a crash mid-write); the reader stops at the first bad frame and reports its offset.
  Token-sized columns (``list<int32>``, ``list<int8>``, ``list<float32>`` in the schema) are packed
  as msgpack ext types holding the raw little-endian array (ext 1 = int32, 2 = int8, 3 = float32)
  instead of one msgpack number per token. That is what makes the journal cheap: converting a list
  to an `array.array` once costs less than msgpack-encoding its numbers, the same bytes become the
  Arrow column without touching a Python int again, and the pending rows take 4 bytes a token in
  memory instead of ~36. Any msgpack reader can still decode a payload (``ext_hook`` turns them
  back into arrays; see `decode_record`).
- ``<journal_dir>/committed``: the manifest, one ``<n> <dataset>`` line per (segment, dataset) whose
  rows are all in durable shards. It is appended and fsynced *before* a segment is deleted, so a segment
  that survives a crash after its shards were written is not written twice. A round of shards can
  take several files (pieces, days) before its segments are committed, so each shard is announced
  first with an ``intent <dataset> <path>`` line (fsynced before the file becomes visible) and a
  ``done <dataset>`` line closes a round whose segments are all committed: after a crash mid-round,
  recovery reads the keys of the announced shards that exist and does not write those rows again.
- ``<journal_dir>/LOCK``: an flock held by the one Store (or `recover`) using the directory.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import logging
import os
import re
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pyarrow as pa

from .files import fsync_dir, replace_text
from .schema import SCHEMAS

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")
# A single row above this is certainly a corrupt length field, not data (rows hold at most a few
# hundred thousand token ids plus JSON).
MAX_RECORD_BYTES = 1 << 30
SEGMENT_RE = re.compile(r"^seg-(\d{8,})\.log$")
MANIFEST_NAME = "committed"
LOCK_NAME = "LOCK"
REJECTED_NAME = "rejected.log"

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)

# array typecode for each list value type we pack raw, and its msgpack ext code.
_TYPECODES = {pa.int32(): "i", pa.int8(): "b", pa.float32(): "f"}
EXT_CODES = {"i": 1, "b": 2, "f": 3}
_EXT_TYPECODES = {v: k for k, v in EXT_CODES.items()}
assert array("i").itemsize == 4 and array("b").itemsize == 1 and array("f").itemsize == 4
_SWAP = sys.byteorder != "little"

# dataset -> {column: array typecode} for the columns packed as raw arrays.
TYPED_COLUMNS: dict[str, dict[str, str]] = {
    name: {
        f.name: _TYPECODES[f.type.value_type]
        for f in schema
        if pa.types.is_list(f.type) and f.type.value_type in _TYPECODES
    }
    for name, schema in SCHEMAS.items()
}


def segment_name(n: int) -> str:
    return f"seg-{n:08d}.log"


def _default(obj: Any) -> Any:
    """msgpack fallback: the few non-msgpack types a caller may reasonably hand us.

    Datetimes become int microseconds since the epoch (UTC; naive ones are taken as UTC), which is
    what the timestamp columns store. Numpy arrays / scalars become lists / Python numbers.
    """
    if isinstance(obj, _dt.datetime):
        if obj.tzinfo is None:
            obj = obj.replace(tzinfo=_dt.UTC)
        delta = obj - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if isinstance(obj, array):
        code = EXT_CODES.get(obj.typecode)
        if code is None:
            return obj.tolist()
        if _SWAP:
            obj = array(obj.typecode, obj)
            obj.byteswap()
        return msgpack.ExtType(code, obj.tobytes())
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"cannot journal a value of type {type(obj).__name__}")


def prepare_row(dataset: str, row: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``row`` with its token-sized lists as `array.array`s (see module doc).

    A value that does not fit (a string in an id list, an id beyond int32) is left as it is: the
    conversion to Arrow then rejects the row with a precise reason. The copy also means that a
    caller reusing its dict after the journal has it cannot change what gets stored.
    """
    out = dict(row)
    for name, code in TYPED_COLUMNS.get(dataset, {}).items():
        value = out.get(name)
        if value is None or (isinstance(value, array) and value.typecode == code):
            continue
        try:
            out[name] = array(code, value)
        except (TypeError, ValueError, OverflowError):
            pass
    return out


def pack_record(dataset: str, row: dict[str, Any]) -> bytes:
    """msgpack of ``{"d": dataset, "r": row}`` (raises TypeError/ValueError when unencodable)."""
    return msgpack.packb({"d": dataset, "r": row}, use_bin_type=True, default=_default)


def encode_record(dataset: str, row: dict[str, Any]) -> bytes:
    """Encode one row as a journal payload (raises TypeError/ValueError for unencodable values)."""
    return pack_record(dataset, prepare_row(dataset, row))


def _ext_hook(code: int, data: bytes) -> Any:
    typecode = _EXT_TYPECODES.get(code)
    if typecode is None:
        return msgpack.ExtType(code, data)
    value = array(typecode)
    value.frombytes(data)
    if _SWAP:
        value.byteswap()
    return value


def decode_record(payload: bytes) -> tuple[str, dict[str, Any]]:
    """Decode a journal payload; raises ValueError when it is not a journal record.

    Token-sized columns come back as `array.array` (``.tolist()`` for lists).
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"payload is not msgpack: {exc}") from exc
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("d"), str)
        or not isinstance(obj.get("r"), dict)
    ):
        raise ValueError("payload is not a {d, r} journal record")
    return obj["d"], obj["r"]


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _fdatasync(fd: int) -> None:
    # fdatasync also flushes the size change an append makes, which is all a reader needs.
    sync = getattr(os, "fdatasync", os.fsync)
    sync(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


@dataclass(frozen=True)
class Damage:
    """Where a segment stops being readable: everything from ``offset`` on was skipped."""

    path: str
    offset: int
    skipped_bytes: int
    reason: str

    def __str__(self) -> str:
        return (
            f"{self.path}: {self.reason} at offset {self.offset}; "
            f"skipped {self.skipped_bytes} bytes to the end of the segment"
        )


def read_segment(path: str) -> tuple[list[bytes], Damage | None]:
    """All intact payloads of a segment, in order, and where (if anywhere) it is damaged.

    Segments are append-only, so the only expected damage is a torn tail from a crash mid-write;
    reading stops at the first frame that is short or fails its crc, and reports it once rather than
    guessing where the next record might start.
    """
    with open(path, "rb") as f:
        data = f.read()
    payloads: list[bytes] = []
    offset = 0
    end = len(data)
    while offset < end:
        reason = None
        if end - offset < HEADER.size:
            reason = "torn record header"
        else:
            length, crc = HEADER.unpack_from(data, offset)
            start = offset + HEADER.size
            if length > MAX_RECORD_BYTES:
                reason = f"implausible record length {length}"
            elif start + length > end:
                reason = f"torn record (length {length}, {end - start} bytes present)"
            else:
                payload = data[start : start + length]
                if zlib.crc32(payload) != crc:
                    reason = "crc mismatch"
                else:
                    payloads.append(payload)
                    offset = start + length
                    continue
        return payloads, Damage(path, offset, end - offset, reason)
    return payloads, None


def list_segments(journal_dir: str) -> list[tuple[int, str]]:
    """(number, path) of every segment file in the directory, oldest first."""
    try:
        names = os.listdir(journal_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = SEGMENT_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(journal_dir, name)))
    return sorted(found)


class SegmentWriter:
    """Appends framed batches to the current segment, one fdatasync per batch (group commit).

    Not thread-safe on its own: the Store serialises calls under its lock. The file of a segment is
    created lazily on its first batch, so rotating an idle journal leaves no empty files behind.
    """

    def __init__(self, journal_dir: str, next_number: int) -> None:
        self.dir = journal_dir
        self.number = next_number
        self._fd: int | None = None
        self._size = 0
        self.fsyncs = 0

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def path(self, n: int | None = None) -> str:
        return os.path.join(self.dir, segment_name(self.number if n is None else n))

    def write_batch(self, frames: Iterable[bytes]) -> int:
        """Append the frames and make them durable; returns the segment number they went into.

        On failure the segment is abandoned (closed; truncated back to its last durable size when
        possible) and the next batch goes to a fresh segment: after a failed write or fsync the
        kernel's view of the file can no longer be trusted, and a new file sidesteps that.
        """
        data = b"".join(frames)
        if self._fd is None:
            fd = os.open(self.path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                fsync_dir(self.dir)
            except OSError:
                os.close(fd)
                raise
            self._fd, self._size = fd, 0
        try:
            _write_all(self._fd, data)
            _fdatasync(self._fd)
        except OSError:
            self._abandon()
            raise
        self._size += len(data)
        self.fsyncs += 1
        return self.number

    def rotate(self) -> None:
        """Close the current segment (if it has any data); later batches go to the next number."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.number += 1

    def close(self) -> None:
        self.rotate()

    def _abandon(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, self._size)
        except OSError:
            pass  # the torn tail stays; recovery stops there, and the rows are rewritten elsewhere
        try:
            os.close(fd)
        except OSError:
            pass
        self.number += 1


class Manifest:
    """The ``committed`` file: which (segment, dataset) pairs are already in durable shards, and
    which shards of an unfinished round may exist (``intents``, see the module doc)."""

    def __init__(self, journal_dir: str) -> None:
        self.dir = journal_dir
        self.path = os.path.join(journal_dir, MANIFEST_NAME)
        self.lines = 0
        # (dataset, shard path) announced after the dataset's last ``done`` line, by `load`
        self.intents: list[tuple[str, str]] = []

    def load(self) -> set[tuple[int, str]]:
        """Entries in the file (and `intents`); a torn or malformed line (crash mid-append) is
        ignored, which can only cause rows to be written again, never lost."""
        entries: set[tuple[int, str]] = set()
        self.intents = []
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            return entries
        if text and not text.endswith("\n"):  # a torn last line
            text = text[: text.rfind("\n") + 1]
        lines = text.splitlines()
        for line in lines:
            parts = line.split(" ", 2)
            if len(parts) == 2 and parts[0].isdigit():
                entries.add((int(parts[0]), parts[1]))
            elif len(parts) == 3 and parts[0] == "intent":
                self.intents.append((parts[1], parts[2]))
            elif len(parts) == 2 and parts[0] == "done":
                self.intents = [(d, p) for d, p in self.intents if d != parts[1]]
        self.lines = len(lines)
        return entries

    def _append_text(self, text: str, sync: bool = True) -> None:
        new = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, text.encode())
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            fsync_dir(self.dir)
        self.lines += text.count("\n")

    def append(self, entries: Iterable[tuple[int, str]]) -> None:
        text = "".join(f"{n} {d}\n" for n, d in sorted(entries))
        if text:
            self._append_text(text)

    def append_intent(self, dataset: str, path: str) -> None:
        """Announce a shard (durably) before it becomes visible."""
        if "\n" in path:
            raise ValueError(f"shard path {path!r} contains a newline")
        self._append_text(f"intent {dataset} {path}\n")

    def append_done(self, dataset: str) -> None:
        """Every intent of ``dataset`` so far is covered by committed segments. Not fsynced:
        losing it only makes recovery check a few more shards."""
        self._append_text(f"done {dataset}\n", sync=False)

    def rewrite(
        self, entries: Iterable[tuple[int, str]], intents: Iterable[tuple[str, str]] = ()
    ) -> None:
        """Atomically replace the manifest with ``entries`` and the still-open ``intents`` (used to
        drop lines of deleted segments).

        Callers must have made the deletions durable first (fsync of the journal dir); otherwise a
        deleted segment could reappear after a crash with its manifest line gone.
        """
        entries = sorted(set(entries))
        intents = list(dict.fromkeys(intents))
        if not entries and not intents:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            else:
                fsync_dir(self.dir)
            self.lines = 0
            return
        text = "".join(f"{n} {d}\n" for n, d in entries)
        text += "".join(f"intent {d} {p}\n" for d, p in intents)
        replace_text(self.path, text, tmp=self.path + ".tmp")
        self.lines = len(entries) + len(intents)


class DirectoryLock:
    """An exclusive flock on ``<journal_dir>/LOCK``: two writers on one journal would corrupt it."""

    def __init__(self, journal_dir: str) -> None:
        self.path = os.path.join(journal_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RuntimeError(
                    f"journal directory {os.path.dirname(self.path)} is in use by another polar-mitm "
                    "store (give each proxy its own journal_dir)"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock


def append_rejected(journal_dir: str, payloads: Iterable[bytes]) -> None:
    """Keep rows that can never become Parquet (wrong types, missing required columns) in a
    dead-letter file with the journal's framing, instead of dropping them or retrying forever."""
    path = os.path.join(journal_dir, REJECTED_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, b"".join(frame(p) for p in payloads))
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Decoded (dataset, row) records of a segment or of ``rejected.log``, arrays as plain lists
    (a debugging helper)."""
    payloads, _ = read_segment(path)
    for p in payloads:
        dataset, row = decode_record(p)
        yield dataset, {k: v.tolist() if isinstance(v, array) else v for k, v in row.items()}
