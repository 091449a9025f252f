"""`./scripts/demo.sh --vllm`: the main job (the real Pi) against the real vLLM, as a user runs
it: the task done, three calls of one rollout captured, one trainable trace, and nothing of vLLM
left running afterwards (the demo starts and stops its own server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def vllm_processes() -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                name = open(f"/proc/{entry}/comm").read().strip()  # noqa: SIM115
            except OSError:
                continue
            if name.startswith("VLLM::"):
                found.add(int(entry))
    return found


@pytest.mark.slow
def test_demo_vllm(vllm_setup, tmp_path):
    before = vllm_processes()
    out = tmp_path / "demo"
    env = {**os.environ, "POLAR_DEMO_SESSION": "pi", "POLAR_DEMO_OUT": str(out), "COLUMNS": "200"}
    proc = subprocess.run(
        ["./scripts/demo.sh", "--vllm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "starting the real vLLM" in proc.stdout
    assert "hello.txt (written by Pi's bash tool): polar was here" in proc.stdout
    summary = subprocess.run(
        [sys.executable, "-m", "polar_mitm.cli.app", "summary", str(out / "data"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    [rollout] = [
        r for r in json.loads(summary.stdout)["rollouts"] if r["rollout_id"] == "demo-task.0"
    ]
    assert rollout["calls"] == 3 and rollout["traces"] == 1 and rollout["trainable"], rollout
    assert vllm_processes() <= before  # the demo's server is gone
