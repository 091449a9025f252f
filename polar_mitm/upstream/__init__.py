"""Policy servers. Each module holds one `Upstream`; `UPSTREAMS` maps `polar_upstream_kind` to it."""

from __future__ import annotations

from .base import TokenTally, Upstream
from .vllm import VLLM

UPSTREAMS: dict[str, type[Upstream]] = {cls.kind: cls for cls in (VLLM,)}

__all__ = ["UPSTREAMS", "TokenTally", "Upstream"]
