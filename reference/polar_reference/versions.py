"""The server versions the reference policy server imitates, stated once.

Everything version-dependent in ``vllm_wire.py``, ``sglang_wire.py``, ``generation.py`` and
``completions.py`` follows these releases' own source (docs/upstreams.md cites file and line).
Where a behaviour changed between releases and the proxy must handle both, the older one is a
server option (``--vllm-limits``), named here too.
"""

from __future__ import annotations

#: The vLLM release whose chat and completions endpoints the ``vllm`` kind imitates.
VLLM_VERSION = "0.33.0"
#: The SGLang release whose chat endpoint and ``/generate`` the ``sglang`` kind imitates.
SGLANG_VERSION = "0.5.23"

#: How the ``vllm`` kind applies the context length to a request (``--vllm-limits``):
#: ``0.33`` — a ``max_tokens`` above ``max_model_len`` is refused, one that only does not fit beside
#: the prompt is clamped silently, a prompt over ``max_model_len`` is refused
#: (``vllm/renderers/params.py``); ``0.10`` — older vLLM (0.10/0.11 ``serving_engine.py``), which
#: refused ``prompt + max_tokens > max_model_len`` with "... maximum context length ...".
VLLM_LIMITS = ("0.33", "0.10")
