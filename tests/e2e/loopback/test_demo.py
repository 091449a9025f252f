"""`./scripts/demo.sh`, as a user on this machine runs it: both sessions (the real Pi harness, and
the openai-SDK session), each ending with a summary of 3 captured calls for one rollout, the main
trace decoded as text with its fidelity line, and where the files are."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("session", ["sdk", "pi"])
def test_demo_prints_a_summary_of_three_calls(tmp_path, session):
    if session == "pi" and not (shutil.which("node") and shutil.which("npm")):
        pytest.fail("the Pi demo needs Node.js and npm (scripts/test.sh installs the harnesses)")
    out = tmp_path / "demo"
    env = {
        **os.environ,
        "POLAR_DEMO_SESSION": session,
        "POLAR_DEMO_OUT": str(out),
        "COLUMNS": "200",
    }
    proc = subprocess.run(
        ["./scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "== captured under" in proc.stdout and "demo-task.0" in proc.stdout
    summary = subprocess.run(
        [sys.executable, "-m", "polar_mitm.cli.app", "summary", str(out / "data"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    data = json.loads(summary.stdout)
    [rollout] = [r for r in data["rollouts"] if r["rollout_id"] == "demo-task.0"]
    assert rollout["calls"] == 3, rollout
    # the proxy checked every call with the shipped Qwen3 tokenizer and recorded it with the
    # shards: `show` decodes the trace by itself and says what the checks found
    recorded = json.loads((out / "data" / "_polar_tokenizer.json").read_text())
    assert recorded["spec"].endswith("tokenizer_files") and recorded["kind"] == "hf"
    assert rollout["fidelity_checked"] == 3 and data["totals"]["fidelity_checked"] >= 3
    shown = proc.stdout.split("the main trace of demo-task.0 as text", 1)[1]
    shown = shown.split("== where the files are", 1)[0]
    assert "(the proxy's polar_tokenizer)" in shown and "showing ids" not in shown
    assert "<|im_start|>assistant" in shown and "<|im_end|>" in shown  # decoded, not ids
    assert not any(
        line.split() and all(w.isdigit() for w in line.split()) for line in shown.splitlines()
    )
    fidelity = [line for line in shown.splitlines() if line.startswith("fidelity")]
    assert fidelity and re.search(r"checked (\d+)/\1 calls", fidelity[0]), shown[:3000]
    assert "not checked" not in proc.stdout
    assert f"{out / 'data'}/calls/" in proc.stdout.split("== where the files are", 1)[1]
    if session == "pi":
        assert (out / "work" / "hello.txt").read_text() == "polar was here"
        assert "reward 1.0" in proc.stdout
    if session == "sdk":  # the docs site's pictures, made from this demo's data (docs/pictures.md)
        pictures = tmp_path / "pictures"
        made = subprocess.run(
            [sys.executable, "docs/tools/pictures.py", str(out / "data"), str(pictures)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert made.returncode == 0, made.stderr
        svg = (pictures / "show.svg").read_text()
        assert svg.startswith("<svg") and "demo-task.0" in svg and "im_start" in svg
        png = (pictures / "report.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
