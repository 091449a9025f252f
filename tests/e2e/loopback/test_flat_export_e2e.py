"""`polar-mitm export --format parquet`: one row per trace with its latest reward, read as is by
Hugging Face `datasets`, Ray Data and DuckDB (issue 46). The raw `traces/` folder keeps every
revision (a reward joined later is a new row): read by those same readers without polar-mitm it
gives a trace once per revision, which is what this export is for. The session is a real one
(tests/helpers/capture_session.py); the rewards are joined twice with `polar-mitm reward`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from polar_mitm.store import read_table
from tests.helpers.capture_session import produce
from tests.helpers.procs import BIN

pytestmark = [pytest.mark.timeout(420), pytest.mark.xdist_group("ray"), pytest.mark.slow]
POLAR = str(BIN / "polar-mitm")


def polar(*args: str) -> str:
    done = subprocess.run([POLAR, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, confdir: Path) -> dict:
    tmp = tmp_path_factory.mktemp("flat")
    data = produce(tmp, confdir).output
    traces = read_table(str(data), "traces").to_pylist()  # polar-mitm's reader: latest revision
    rewarded = sorted({t["rollout_id"] for t in traces if t["trainable"]})
    for reward in (0.5, 0.25):  # two joins: each trace of these rollouts gets two more revisions
        lines = [json.dumps({"rollout_id": r, "reward": reward}) for r in rewarded]
        (tmp / "rewards.jsonl").write_text("\n".join(lines) + "\n")
        polar("reward", str(data), str(tmp / "rewards.jsonl"))
    out = tmp / "traces.parquet"
    polar("export", str(data), "--format", "parquet", "--out", str(out), "--all")
    raw = sorted(str(p) for p in (Path(data) / "traces").rglob("*.parquet"))
    truth = read_table(str(data), "traces").to_pylist()
    return {"out": str(out), "raw": raw, "truth": truth, "rewarded": rewarded}


def test_datasets_gets_one_row_per_trace_and_the_latest_reward(exported: dict):
    datasets = pytest.importorskip("datasets")
    flat = datasets.load_dataset("parquet", data_files=exported["out"], split="train")
    truth = {t["trace_id"]: t for t in exported["truth"]}
    assert len(flat) == len(truth) and len(set(flat["trace_id"])) == len(truth)
    for row in flat:
        want = truth[row["trace_id"]]
        assert row["reward"] == want["reward"] and row["revision"] == want["revision"]
        assert row["input_ids"] == want["input_ids"] and row["loss_mask"] == want["loss_mask"]
    last = [r["reward"] for r in flat if r["rollout_id"] in exported["rewarded"]]
    assert last and set(last) == {0.25}  # the last join's, never an earlier revision's
    # what the raw folder gives the same reader: every revision, the reason for this export
    raw = datasets.load_dataset("parquet", data_files=exported["raw"], split="train")
    assert len(raw) > len(flat)


def test_duckdb_and_ray_read_it_as_is(exported: dict):
    duckdb = pytest.importorskip("duckdb")
    ray = pytest.importorskip("ray")
    out, n = exported["out"], len(exported["truth"])
    [(rows, traces)] = duckdb.sql(
        f"SELECT count(*), count(DISTINCT trace_id) FROM read_parquet('{out}')"
    ).fetchall()
    assert rows == traces == n
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.read_parquet(out)
        assert ds.count() == n
        rewards = sorted(
            r["reward"] for r in ds.select_columns(["reward"]).take_all() if r["reward"] is not None
        )
        assert rewards == sorted(t["reward"] for t in exported["truth"] if t["reward"] is not None)
    finally:
        ray.shutdown()
