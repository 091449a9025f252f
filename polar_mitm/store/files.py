"""Files replaced whole: a reader sees the old file or the new one, never half of either.

Shards, the journal's manifest, the proxy id, a migrated shard, an export and the tokenizer
sidecar are all written the same way: into a temp file in the target's directory (a rename
across file systems is not atomic), then renamed over the target; on any error the temp file is
removed and the target is as it was. Durable writes also fsync the file before the rename and the
directory after it, so a crash cannot leave the new name pointing at unwritten blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def fsync_dir(path: str) -> None:
    """Make a directory entry change (create, rename, unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_whole[T](
    path: str,
    write: Callable[[str], T],
    *,
    tmp: str | None = None,
    durable: bool = True,
    before_rename: Callable[[str], None] | None = None,
) -> T:
    """Write ``path`` whole or not at all; returns what ``write`` returns.

    ``write(tmp)`` fills the temp file (default name ``.<name>.tmp`` beside ``path``; callers
    whose leftovers recovery must recognize name their own). ``before_rename(tmp)`` runs once the
    temp file is complete (and fsynced when ``durable``), just before it takes the name: the store
    announces a shard there, migrate measures it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = tmp or os.path.join(directory, "." + os.path.basename(path) + ".tmp")
    try:
        result = write(tmp)
        if durable:
            fsync_file(tmp)
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(directory)
    return result


def replace_text(path: str, text: str, *, tmp: str | None = None, durable: bool = True) -> None:
    """`replace_whole` for a small text file (UTF-8)."""

    def write(name: str) -> None:
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)

    replace_whole(path, write, tmp=tmp, durable=durable)
