"""A reference policy server that speaks vLLM's exact OpenAI chat-completions wire format.

It plays scripted coding-agent turns (``scenario.py``) with real token ids from a Hugging Face
tokenizer and chat template (``render.py``), so the proxy's tests, demo and benchmarks run without a
GPU. Start it with ``polar-reference`` or ``python -m polar_reference``; embed it
with :class:`PolicyServer`. With ``--real`` / ``--gguf`` a real GGUF model sampled by llama.cpp
replaces the scripted turns (``real.py``, ``llama_engine.py``; docs/realmodel.md).
"""

from .render import Renderer
from .scenario import (
    Scenario,
    ScenarioError,
    bundled_scenario,
    demo_scenario_path,
    load_scenario,
    parse_scenario,
)
from .server import PolicyServer, ServerConfig

__all__ = [
    "PolicyServer",
    "Renderer",
    "Scenario",
    "ScenarioError",
    "ServerConfig",
    "bundled_scenario",
    "demo_scenario_path",
    "load_scenario",
    "parse_scenario",
]
