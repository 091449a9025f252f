"""polar-mitm's benchmarks: what the proxy costs a rollout farm, measured, saved, rendered.

``python -m polar_bench SCENARIO`` runs one scenario (``__main__.py`` lists them); every scenario
module stands on ``core.py`` (processes, client, samples, CPU and memory readings, the results
file) and on the product and the reference policy server, never on another scenario's internals
in a cycle (tests/test_layout.py). Runs saved as JSON (``--json``, with the machine and the
versions) are rendered into docs/performance.md by ``python -m polar_bench render``.

Run from a checkout (the package is not installed: the proxies it starts run this checkout's
addon).
"""
