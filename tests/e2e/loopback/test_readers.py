"""The shards read by the tools RL teams use: DuckDB, Hugging Face ``datasets``, Ray Data.

Slow (Ray starts a local cluster; ~15 s), still run in CI. Each reader must give the row counts
and token sums that were written — the truth is the rows the test wrote, not another reader.
The last test is the many-proxies layout: several real mitmdump processes writing to one bucket,
and a Ray Data job reading every shard to compute per-group statistics.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from polar_mitm.store import CALLS_SCHEMA, Store, list_shards, read_table
from tests.e2e.loopback.test_capture_e2e import SCENARIO
from tests.helpers import ROOT
from tests.helpers.clients import http_client
from tests.helpers.s3 import MotoS3
from tests.test_store_delta import interleaved
from tests.test_store_delta import session as agent_session

pytestmark = pytest.mark.slow

T0 = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z, microseconds
DAY = 86_400_000_000


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 << 20,
    )
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.default_hash_shuffle_parallelism = 2  # 200 partitions by default: for a cluster
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Calls over three days in several shards per day, written by the Store; and the truth."""
    out = tmp_path_factory.mktemp("readers") / "polar-data"
    rng = random.Random(11)
    rows = []
    for i in range(90):
        prompt = [rng.randrange(151_000) for _ in range(rng.randint(1, 400))]
        output = [rng.randrange(151_000) for _ in range(rng.randint(1, 60))]
        rows.append(
            {
                "call_id": f"call-{i:03d}",
                "rollout_id": f"task-{i % 5}.{i % 4}",
                "group_id": f"task-{i % 5}",
                "sample_index": i % 4,
                "started_at": T0 + (i % 3) * DAY + i,
                "finished_at": T0 + (i % 3) * DAY + i + 1000,
                "prompt_token_ids": prompt,
                "output_token_ids": output,
                "output_logprobs": [-0.5] * len(output),
                "usage_completion_tokens": len(output),
                "status": "completed",
                "trainable": i % 7 != 0,
            }
        )
    with Store(out, flush_rows=16) as store:
        for row in rows:
            store.append("calls", row)
    truth = {
        "rows": len(rows),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in rows),
        "output_tokens": sum(len(r["output_token_ids"]) for r in rows),
        "output_id_sum": sum(sum(r["output_token_ids"]) for r in rows),
        "days": 3,
    }
    assert len(list_shards(out, "calls")) >= 6  # several shards in each of the three days
    return {"out": out, "truth": truth}


def test_duckdb_reads_the_hive_partitioned_shards(written: dict) -> None:
    duckdb = pytest.importorskip("duckdb")
    out, truth = written["out"], written["truth"]
    glob = f"{out}/calls/**/*.parquet"
    con = duckdb.connect()
    n, prompt, output, id_sum, days = con.execute(
        "SELECT count(*), sum(len(prompt_token_ids)), sum(len(output_token_ids)), "
        "sum(list_sum(output_token_ids)), count(DISTINCT date) "
        f"FROM read_parquet('{glob}', hive_partitioning = true)"
    ).fetchone()
    assert (n, prompt, output, id_sum, days) == (
        truth["rows"],
        truth["prompt_tokens"],
        truth["output_tokens"],
        truth["output_id_sum"],
        truth["days"],
    )
    # the date partition prunes: one day is a third of the rows
    (one_day,) = con.execute(
        f"SELECT count(*) FROM read_parquet('{glob}', hive_partitioning = true) "
        "WHERE CAST(date AS VARCHAR) = '2023-11-15'"
    ).fetchone()
    assert one_day == truth["rows"] // 3


def test_hf_datasets_load_dataset_parquet(
    written: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    out, truth = written["out"], written["truth"]
    # features from the schema: what keeps shards written before a new column loadable
    dset = datasets.load_dataset(
        "parquet",
        data_files={"train": f"{out}/calls/**/*.parquet"},
        split="train",
        features=datasets.Features.from_arrow_schema(CALLS_SCHEMA),
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert dset.num_rows == truth["rows"]
    table = dset.with_format("arrow")[:]
    assert pc.sum(pc.list_value_length(table["prompt_token_ids"])).as_py() == truth["prompt_tokens"]
    assert pc.sum(pc.list_value_length(table["output_token_ids"])).as_py() == truth["output_tokens"]
    assert pc.sum(pc.list_flatten(table["output_token_ids"])).as_py() == truth["output_id_sum"]
    assert dset.features["prompt_token_ids"].feature.dtype == "int32"


def test_no_reader_gets_a_part_under_a_whole_prompts_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent sessions, whose later calls the Store keeps as parts (a prompt's suffix, a request's
    middle): DuckDB, `datasets` and pyarrow without polar-mitm get under ``prompt_token_ids`` /
    ``request_json`` the whole value or null, never a part; DuckDB with the shipped macros
    (polar_mitm/store/polar.sql) gets every one whole."""
    duckdb = pytest.importorskip("duckdb")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = interleaved(agent_session("a", 6, 1), agent_session("b", 6, 2))
    truth = {r["call_id"]: r for r in rows}
    out = tmp_path / "polar-data"
    with Store(out, flush_rows=4) as store:
        for row in rows:
            store.append("calls", row)
    glob = f"{out}/calls/**/*.parquet"
    plain = {
        "pyarrow": ds.dataset(str(out / "calls"), format="parquet", partitioning="hive")
        .to_table()
        .to_pylist(),
        "duckdb": [
            {"call_id": c, "prompt_token_ids": p, "request_json": q}
            for c, p, q in duckdb.sql(
                "SELECT call_id, prompt_token_ids, request_json "
                f"FROM read_parquet('{glob}', union_by_name = true)"
            ).fetchall()
        ],
        "datasets": datasets.load_dataset(
            "parquet",
            data_files={"train": glob},
            split="train",
            features=datasets.Features.from_arrow_schema(CALLS_SCHEMA),
            cache_dir=str(tmp_path / "hf-cache"),
        ).to_list(),
    }
    for reader, got in plain.items():
        assert len(got) == len(rows), reader
        parts = 0
        for r in got:
            prompt, request = r["prompt_token_ids"], r["request_json"]
            prompt = None if prompt is None else list(prompt)
            assert prompt in (None, truth[r["call_id"]]["prompt_token_ids"]), reader
            assert request in (None, truth[r["call_id"]]["request_json"]), reader
            parts += prompt is None
        assert parts == 2 * 5, reader  # each rollout's calls after its first
    con = duckdb.connect()
    con.execute((ROOT / "polar_mitm/store/polar.sql").read_text())
    whole = con.execute(
        f"SELECT call_id, prompt_token_ids, request_json FROM polar_calls('{out}')"
    ).fetchall()
    assert {c: (p, q) for c, p, q in whole} == {
        c: (r["prompt_token_ids"], r["request_json"]) for c, r in truth.items()
    }


def _lengths(batch: pa.Table) -> pa.Table:
    """Per-row token counts: the kind of map a training-data job runs over the shards."""
    return pa.table(
        {
            "group_id": batch["group_id"],
            "prompt": pc.list_value_length(batch["prompt_token_ids"]).cast(pa.int64()),
            "output": pc.list_value_length(batch["output_token_ids"]).cast(pa.int64()),
        }
    )


def test_ray_data_read_parquet(written: dict, ray_local) -> None:
    from ray.data.aggregate import Count, Sum

    out, truth = written["out"], written["truth"]
    # one execution (each Ray Data action costs seconds on two cores)
    got = (
        ray_local.data.read_parquet(str(out / "calls"))
        .map_batches(_lengths, batch_format="pyarrow")
        .aggregate(Count(), Sum("prompt"), Sum("output"))
    )
    assert got == {
        "count()": truth["rows"],
        "sum(prompt)": truth["prompt_tokens"],
        "sum(output)": truth["output_tokens"],
    }


def test_many_proxies_one_bucket_and_a_ray_job_over_every_shard(
    tmp_path: Path, make_mitm, make_policy_server, moto_s3: MotoS3, ray_local
) -> None:
    """Three proxies, one bucket prefix, a journal each: shard names carry the proxy id, so no
    proxy overwrites another's shard; a Ray Data job over all of them gives per-group figures."""
    from ray.data.aggregate import Count, Sum

    fs = moto_s3.filesystem("polar-farm")
    server = make_policy_server(SCENARIO)
    uri = moto_s3.uri("polar-farm", "rl")
    proxies = [
        make_mitm(
            server.url,
            polar_output=uri,
            polar_journal=tmp_path / f"journal{k}",
            polar_flush_rows=2,
        )
        for k in range(3)
    ]
    for mitm in proxies:
        mitm.proc.wait_for("polar-mitm: writing to")
    # a fourth proxy on the first one's journal would corrupt it: refused at start-up, one line
    intruder = make_mitm(
        server.url,
        polar_output=uri,
        polar_journal=tmp_path / "journal0",
        ready=None,  # it never says it is capturing
    )
    intruder.proc.wait_for(r"polar_output: journal directory \S+journal0 is in use")
    assert intruder.proc.popen.wait(10) == 1
    intruder.stop()
    sent: Counter[str] = Counter()
    for k, mitm in enumerate(proxies):
        with http_client(mitm) as client:
            for i in range(5 + k):  # groups spread over the proxies, as a scheduler would
                group = f"task-{(i + k) % 4}"
                r = client.post(
                    "https://api.openai.com/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": f"Bearer polar-{group}.{k}"},
                )
                assert r.status_code == 200, r.text
                sent[group] += 1
    for mitm in proxies:
        assert mitm.stop() == 0, mitm.proc.output()

    paths = list_shards("polar-farm/rl", "calls", filesystem=fs)
    names = [p.rsplit("/", 1)[1] for p in paths]
    name_re = re.compile(r"part-\d{8}T\d{12}Z-([0-9a-f]{8})-\d{8}\.parquet$")
    by_proxy = Counter(name_re.match(n)[1] for n in names)
    assert len(by_proxy) == 3 and all(n >= 2 for n in by_proxy.values()), by_proxy
    assert len(set(names)) == len(names)
    table = ds.dataset(paths, filesystem=fs, format="parquet").to_table()
    assert table.num_rows == sum(sent.values())  # nothing overwritten, nothing doubled
    # each shard's rows come from the proxy its name says
    for path, name in zip(paths, names, strict=True):
        shard = ds.dataset(path, filesystem=fs, format="parquet").to_table(columns=["proxy_id"])
        assert set(shard.column("proxy_id").to_pylist()) == {name.split("-")[2]}

    truth = read_table("polar-farm/rl", "calls", filesystem=fs)
    expected = {
        g: (n, pc.sum(pc.list_value_length(t["output_token_ids"])).as_py())
        for g, n in sent.items()
        for t in [truth.filter(pc.equal(truth["group_id"], g))]
    }
    stats = (
        ray_local.data.read_parquet(
            "polar-farm/rl/calls",
            filesystem=fs,
            columns=["group_id", "prompt_token_ids", "output_token_ids"],
        )
        .map_batches(_lengths, batch_format="pyarrow")
        .groupby("group_id", num_partitions=2)
        .aggregate(Count(), Sum("output"), Sum("prompt"))
        .take_all()
    )
    got = {s["group_id"]: (s["count()"], s["sum(output)"]) for s in stats}
    assert got == expected
    assert all(s["sum(prompt)"] > 0 for s in stats)
