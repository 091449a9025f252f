"""What `polar-mitm export` says about what it left out, and its `--out -` (standard output)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from ..export import ExportOptions
from ..export import export as write_export
from ..export.base import ExportFormat


def left_out_hint(reason: str) -> str:
    if reason.startswith("role "):
        return " (--role to include)"
    if reason == "status incomplete":
        return " (their rollouts never ended: end them with a reward, or --all)"
    return " (--all to include)"


def export_to_stdout(fmt: ExportFormat, records: list, options: ExportOptions) -> Any:
    """`--out -`: the export written whole to a temporary file, then copied to stdout (a
    reader of the pipe gets a complete file or, on an error, nothing)."""
    with tempfile.TemporaryDirectory(prefix="polar-export-") as tmp:
        path = os.path.join(tmp, "export" + fmt.suffix)
        result = write_export(fmt, records, path, options)
        with open(path, "rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return result
