"""The NeMo Gym coding tasks and the trace-to-items conversion, without Gym (standard library).

The e2e test (tests/e2e/test_nemo_gym.py) runs them inside Gym; these check the verifier's edges
that a scripted harness does not reach: a harness that edits the test instead of the code, a test
that hangs, an unknown task, and a workspace that is not there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_mitm.nemo_gym.coding_tasks import TaskError, load_task, seed, task_rows, verify
from polar_mitm.nemo_gym.items import output_items

ROOT = Path(__file__).resolve().parent.parent


def test_a_seeded_task_fails_until_the_code_is_fixed(tmp_path):
    task = load_task("fix-add")
    work = tmp_path / "work"
    seed(task, work)
    before = verify(task, work, timeout=60)
    assert (before.reward, before.passed) == (0.0, False)
    assert before.reason == "the test failed (exit 1)" and "AssertionError" in before.output
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    after = verify(task, work, timeout=60)
    assert (after.reward, after.passed, after.reason) == (1.0, True, None)


def test_editing_the_test_earns_nothing(tmp_path):
    task = load_task("fix-add")
    work = tmp_path / "work"
    seed(task, work)
    (work / "test_calc.py").write_text(
        "import unittest\nclass T(unittest.TestCase):\n    def test(self): pass\n"
    )
    assert verify(task, work, timeout=60).reward == 0.0  # the task's test file was put back


def test_a_hanging_test_times_out_with_a_reason(tmp_path):
    task = load_task("fix-add")
    work = tmp_path / "work"
    seed(task, work)
    (work / "calc.py").write_text("def add(a, b):\n    while True:\n        pass\n")
    verdict = verify(task, work, timeout=2)
    assert (verdict.reward, verdict.reason) == (0.0, "the test did not finish within 2 s")


def test_unknown_tasks_and_missing_workspaces(tmp_path):
    with pytest.raises(TaskError, match=r"no task 'nope' .*\(tasks: fix-add, fix-greeting\)"):
        load_task("nope")
    with pytest.raises(TaskError, match="no task '../fix-add'"):
        load_task("../fix-add")
    with pytest.raises(TaskError, match="absolute path"):
        seed(load_task("fix-add"), Path("relative"))
    verdict = verify(load_task("fix-add"), tmp_path / "absent", timeout=5)
    assert verdict.reward == 0.0 and "does not exist" in (verdict.reason or "")


def test_the_shipped_input_rows_are_the_task_set():
    shipped = ROOT / "resources_servers" / "polar_coding" / "data" / "tasks.jsonl"
    assert [json.loads(line) for line in shipped.read_text().splitlines()] == task_rows()


def test_items_repeat_each_calls_whole_prompt():
    # two calls: prompt 1,2 -> 3,4 sampled; then env 5 -> 6 sampled
    trace = {
        "trace_id": "t",
        "input_ids": [1, 2, 3, 4, 5, 6],
        "loss_mask": [0, 0, 1, 1, 0, 1],
        "logprobs": [0, 0, -0.5, -0.25, 0, -1.0],
        "call_offsets": [0, 4],
        "call_ids": ["c1", "c2"],
    }
    items = output_items(trace)
    assert [(i["id"], i["prompt_token_ids"], i["generation_token_ids"]) for i in items] == [
        ("c1", [1, 2], [3, 4]),
        ("c2", [1, 2, 3, 4, 5], [6]),
    ]
    assert [i["generation_log_probs"] for i in items] == [[-0.5, -0.25], [-1.0]]
