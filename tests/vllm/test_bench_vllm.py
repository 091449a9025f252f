"""polar_bench/vllm.py (`python -m polar_bench vllm`) runs and measures: its own
vLLM server (the bench's scenario), the three columns, the server's CPU per call read from /proc."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_bench_vllm_smoke(vllm_setup, tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run(
        [sys.executable, "-m", "polar_bench", "vllm", "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    cols = results["columns"]
    for column in ("vllm direct", "polar-mitm chat", "polar-mitm token-in"):
        assert cols[column]["calls"] == 3 and cols[column]["errors"] == 0, cols[column]
        assert cols[column]["vllm_cpu_ms_per_call"] > 0
    assert cols["polar-mitm chat"]["routes"] == {"chat": 3, "token_in": 0}
    assert cols["polar-mitm token-in"]["routes"] == {"chat": 1, "token_in": 2}
    assert cols["polar-mitm token-in"]["traces_per_rollout"] == 1.0
    assert "vLLM CPU per call" in proc.stdout


@pytest.mark.slow
def test_bench_farm_smoke(vllm_setup, tmp_path):
    """The farm column: its columns (polar-mitm's chat and exact-prefix modes relayed and
    buffered, and exact-prefix through /inference/v1/generate), vLLM's API-server CPU (that one
    process) and the proxies' per call, each column on its own conversations; buffered calls' ids
    are vLLM's, as relayed ones'."""
    out = tmp_path / "farm.json"
    proc = subprocess.run(
        [sys.executable, "-m", "polar_bench", "farm", "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert "vllm.entrypoints.openai.api_server" in results["config"]["api_server"]
    cols = results["columns"]
    polar = ("polar-mitm chat", "polar-mitm exact")
    polar += (*(f"{c} buffered" for c in polar), "polar-mitm exact generate")
    for column in ("direct", "mitm-stream", "mitm-buffered", *polar):
        assert cols[column]["calls"] == 3 and cols[column]["errors"] == 0, cols[column]
        assert cols[column]["api_cpu_ms_per_call"] > 0 and cols[column]["events_per_call"] > 1
        assert 0 < cols[column]["late_ttfb_ms_p50"] <= cols[column]["late_latency_ms_p50"]
    for column in ("mitm-stream", "mitm-buffered", *polar):
        assert cols[column]["proxy_cpu_ms_per_call"] > 0
    for column in polar:  # from the proxy's own records
        exact = "exact" in column
        assert cols[column]["routes"] == {"chat": 1 if exact else 3, "token_in": 2 if exact else 0}
        assert cols[column]["output_tokens_per_call"] > 1
        checks = cols[column]["checks"]
        assert checks["calls"] == 3 and checks["traces_are_last_call"] == checks["rollouts"] == 1
        for check in ("ids_from_upstream", "count_check_ok", "trainable"):
            assert checks[check] == 3, (column, checks)
    assert "vLLM API-server CPU" in proc.stdout
