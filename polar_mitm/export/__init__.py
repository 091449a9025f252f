"""`polar-mitm export`: traces in a trainer's own format, one module per format.

Each module in this package that defines ``FORMAT`` (an `ExportFormat`) is a format: adding one is
adding a file. `select` decides which traces go out (by default only trainable, completed ones),
`build_records` gives each the per-call view and its calls' facts, and `export` writes the file
atomically (a temp name in the same directory, then a rename).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import tempfile
from collections import Counter

from ..store.files import replace_whole
from .base import ExportFormat, ExportOptions, ExportResult, Record, build_records, select

FORMATS: dict[str, ExportFormat] = {}
for _info in pkgutil.iter_modules(__path__):
    if _info.name.startswith("_") or _info.name == "base":
        continue
    _fmt = getattr(importlib.import_module(f"{__name__}.{_info.name}"), "FORMAT", None)
    if isinstance(_fmt, ExportFormat):
        FORMATS[_fmt.name] = _fmt


def export(
    fmt: ExportFormat, records: list[Record], out: str, options: ExportOptions
) -> ExportResult:
    """Write ``records`` to ``out`` in ``fmt``; a reader never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=fmt.suffix, dir=directory)
    os.close(fd)  # a name of its own: two exports into one directory do not collide

    def write(tmp: str) -> dict | None:
        stats = fmt.write(records, tmp, options)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; an export is an ordinary file
        return stats

    stats = replace_whole(out, write, tmp=tmp, durable=False)
    return ExportResult(
        path=out,
        format=fmt.name,
        records=len(records),
        rollouts=len({r.trace["rollout_id"] for r in records}),
        policy_tokens=sum(r.policy_tokens for r in records),
        without_reward=sum(r.trace.get("reward") is None for r in records),
        roles=dict(Counter(r.trace.get("role") or "unknown" for r in records)),
        extra=stats or {},
    )


__all__ = [
    "FORMATS",
    "ExportFormat",
    "ExportOptions",
    "ExportResult",
    "Record",
    "build_records",
    "export",
    "select",
]
