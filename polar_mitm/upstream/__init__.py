"""Policy servers. Each module holds one `Upstream`; `UPSTREAMS` maps `polar_upstream_kind` to it."""

from __future__ import annotations

from .base import TokenTally, Upstream
from .openai import OpenAICompatible
from .sglang import SGLang
from .vllm import VLLM

UPSTREAMS: dict[str, type[Upstream]] = {cls.kind: cls for cls in (VLLM, SGLang, OpenAICompatible)}


def kind_from_models(data: object) -> tuple[str, str]:
    """``polar_upstream_kind=auto``: the kind a ``GET /v1/models`` body reveals, and the evidence.

    vLLM's and SGLang's model cards say who serves them (``owned_by``); anything else is treated
    as a plain OpenAI-compatible server without token ids.
    """
    cards = data.get("data") if isinstance(data, dict) else None
    owners = [c.get("owned_by") for c in cards or () if isinstance(c, dict)]
    for owner in owners:
        if owner in ("vllm", "sglang"):
            return owner, f"GET /v1/models: owned_by={owner}"
    seen = ",".join(str(o) for o in owners) or "no model cards"
    return "openai", f"GET /v1/models: owned_by={seen}; assuming a server without token ids"


__all__ = ["UPSTREAMS", "TokenTally", "Upstream", "kind_from_models"]
