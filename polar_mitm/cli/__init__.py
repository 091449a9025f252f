"""`polar-mitm`: the click commands and their views of the shards (tables, show, summary, report,
rewards, fidelity report, the shard reader they share).

The old public path `polar_mitm.cli` keeps working: `main` (polar_mitm.cli.app), imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

_MOVED = {"main": "polar_mitm.cli.app"}
__all__ = sorted(_MOVED)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
