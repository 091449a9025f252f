"""The wire kinds by ``--kind`` name (vLLM, SGLang), apart from `wire.py`, which they implement.

The registry imports the kinds; the kinds import `wire.py`. Keeping it out of `wire.py` is what
keeps that import one-way. Each kind is imported when it is chosen, not when the server starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .wire import Wire


def _vllm(**options: Any) -> Wire:
    from .vllm_wire import VllmWire

    return VllmWire(**options)


def _sglang(**options: Any) -> Wire:
    from .sglang_wire import SglangWire

    return SglangWire(**options)


#: Wire kinds by ``--kind`` name; each factory takes the kind's own options as keywords.
WIRE_KINDS: dict[str, Callable[..., Wire]] = {"vllm": _vllm, "sglang": _sglang}
