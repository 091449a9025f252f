"""The durable store: journal -> Parquet shards -> readers, crash recovery, upload failures.

Real files in tmp_path throughout; a crash is a real ``os._exit`` in a child process where it
matters, and a hand-built journal where the exact bytes matter (torn tails, garbage).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm import __version__
from polar_mitm.store import (
    CALLS_SCHEMA,
    SCHEMA_VERSION,
    TRACES_SCHEMA,
    RecoveryReport,
    Store,
    list_shards,
    read_table,
    recover,
)
from polar_mitm.store import journal as journal_mod
from polar_mitm.store.journal import (
    Manifest,
    SegmentWriter,
    encode_record,
    frame,
    list_segments,
    read_segment,
)
from tests.helpers.waits import wait_until

T0 = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z in microseconds
DAY = 86_400_000_000


def call_row(i: int, **extra: object) -> dict:
    row = {
        "call_id": f"call-{i}",
        "rollout_id": f"rollout-{i % 3}",
        "group_id": "g",
        "sample_index": i % 3,
        "started_at": T0 + i,
        "finished_at": T0 + i + 1_500_000,
        "dialect": "openai_chat",
        "stream": True,
        "prompt_token_ids": list(range(i, i + 20)),
        "output_token_ids": [7, 8, 9],
        "output_logprobs": [-0.5, -0.25, 0.0],
        "usage_prompt_tokens": 20,
        "fidelity_flags": ["ok"],
        "request_json": '{"messages": []}',
    }
    row.update(extra)
    return row


def trace_row(i: int, revision: int = 0, **extra: object) -> dict:
    row = {
        "trace_id": f"trace-{i}",
        "revision": revision,
        "rollout_id": f"rollout-{i % 3}",
        "role": "main",
        "call_ids": [f"call-{i}"],
        "input_ids": [1, 2, 3, 4],
        "loss_mask": [0, 0, 1, 1],
        "logprobs": [0.0, 0.0, -0.5, -0.125],
        "reward": None if revision == 0 else 1.0,
        "created_at": T0 + i,
    }
    row.update(extra)
    return row


def journal_dir(out: Path) -> Path:
    return out / "_journal"


def write_segment(jdir: Path, n: int, records: list[tuple[str, dict]]) -> Path:
    """A segment as a crashed run leaves it: records fsynced, never sharded."""
    jdir.mkdir(parents=True, exist_ok=True)
    writer = SegmentWriter(str(jdir), n)
    writer.write_batch([frame(encode_record(d, r)) for d, r in records])
    writer.close()
    return jdir / journal_mod.segment_name(n)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "polar-data"


# -- round trip -------------------------------------------------------------------------------------


def test_round_trip_types_and_timestamps(out: Path) -> None:
    rows = [call_row(i) for i in range(50)]
    rows[3]["prompt_token_ids"] = []  # empty list stays empty, not null
    rows[4].pop("output_logprobs")  # missing key = null
    with Store(out) as store:
        for row in rows:
            store.append("calls", row)
        store.append("traces", trace_row(1))
        assert store.flush(timeout=30)
    table = read_table(out, "calls")
    assert table.schema.remove_metadata() == CALLS_SCHEMA
    assert table.to_pylist() == pa.Table.from_pylist(rows, schema=CALLS_SCHEMA).to_pylist()
    got = table.to_pylist()
    assert got[0]["started_at"] == dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.UTC)
    assert got[7]["started_at"] == dt.datetime(2023, 11, 14, 22, 13, 20, 7, tzinfo=dt.UTC)
    assert got[3]["prompt_token_ids"] == [] and got[4]["output_logprobs"] is None
    assert got[0]["output_logprobs"] == [-0.5, -0.25, 0.0]  # exact in float32
    traces = read_table(out, "traces")
    assert traces.schema.remove_metadata() == TRACES_SCHEMA
    assert traces.to_pylist()[0]["loss_mask"] == [0, 0, 1, 1]


def test_datetimes_are_accepted_as_timestamps(out: Path) -> None:
    when = dt.datetime(2024, 2, 29, 12, 0, 0, 123456, tzinfo=dt.UTC)
    with Store(out) as store:
        store.append("calls", call_row(1, started_at=when, finished_at=when.replace(tzinfo=None)))
    row = read_table(out, "calls").to_pylist()[0]
    assert row["started_at"] == when and row["finished_at"] == when
    assert "date=2024-02-29" in list_shards(out, "calls")[0]


def test_shard_files_metadata_hive_partitions_and_names(out: Path) -> None:
    with Store(out, proxy_id="proxy-a") as store:
        for i in range(4):
            store.append("calls", call_row(i, started_at=T0 + i * DAY))  # four UTC days
        store.append("traces", trace_row(1))
    shards = list_shards(out, "calls")
    assert len(shards) == 4
    for path in shards:
        name = os.path.basename(path)
        assert name.startswith("part-") and name.endswith("-proxy-a-00000001.parquet")
        meta = pq.read_metadata(path)
        assert meta.metadata[b"schema_version"] == str(SCHEMA_VERSION).encode()
        assert meta.metadata[b"producer"] == f"polar-mitm {__version__}".encode()
        assert pq.read_schema(path).field("started_at").type == pa.timestamp("us", tz="UTC")
        assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    (out / "calls" / "date=2023-11-14" / ".part-x-other-00000009.parquet.tmp").write_bytes(b"torn")
    dataset = ds.dataset(out / "calls", format="parquet", partitioning="hive")
    table = dataset.to_table()
    assert table.num_rows == 4 and "date" in table.column_names
    days = {r["call_id"]: str(r["date"]) for r in table.select(["call_id", "date"]).to_pylist()}
    assert days == {
        "call-0": "2023-11-14",
        "call-1": "2023-11-15",
        "call-2": "2023-11-16",
        "call-3": "2023-11-17",
    }
    one_day = dataset.to_table(filter=ds.field("date") == days["call-2"])
    assert one_day.column("call_id").to_pylist() == ["call-2"]
    assert ds.dataset(out / "traces", format="parquet", partitioning="hive").count_rows() == 1


def test_token_ids_are_dictionary_encoded_and_json_is_not(out: Path) -> None:
    """Ids as dictionary indices pack tighter under zstd (docs/store.md, "Row groups and shard
    size"); a JSON body is new every row, so a dictionary would only cost time."""
    history = '{"messages": [' + ", ".join(f'"turn {k} of the task"' for k in range(40))
    with Store(out) as store:
        store.append("calls", call_row(1, request_json=history + "]}"))
        # the same rollout's next call: stored as what it adds (request_middle)
        store.append("calls", call_row(4, request_json=history + ', "a new turn"]}'))
        store.append("traces", trace_row(1))

    def encodings(dataset: str) -> dict[str, tuple[tuple[str, ...], str]]:
        group = pq.ParquetFile(list_shards(out, dataset)[0]).metadata.row_group(0)
        columns = (group.column(c) for c in range(group.num_columns))
        return {c.path_in_schema.split(".")[0]: (c.encodings, c.compression) for c in columns}

    calls, traces = encodings("calls"), encodings("traces")
    for enc, compression in (calls["prompt_token_ids"], traces["input_ids"], traces["loss_mask"]):
        assert "RLE_DICTIONARY" in enc and compression == "ZSTD"
    assert "RLE_DICTIONARY" not in calls["request_json"][0]
    shard = list_shards(out, "calls")[0]
    middles = pq.read_table(shard, columns=["request_middle"]).column(0).to_pylist()
    assert middles.count(None) == 1 and "RLE_DICTIONARY" not in calls["request_middle"][0]
    assert "RLE_DICTIONARY" in calls["rollout_id"][0]
    assert "RLE_DICTIONARY" not in traces["logprobs"][0]
    back = read_table(out, "traces").to_pylist()[0]
    assert back["input_ids"] == [1, 2, 3, 4] and back["loss_mask"] == [0, 0, 1, 1]


def test_partition_falls_back_to_finished_at_then_now(out: Path) -> None:
    with Store(out) as store:
        store.append("calls", call_row(1, started_at=None, finished_at=T0 + DAY))
        store.append("calls", call_row(2, started_at=None, finished_at=None))
    dirs = sorted(os.path.basename(os.path.dirname(p)) for p in list_shards(out, "calls"))
    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert dirs == sorted(["date=2023-11-15", f"date={today}"])


# -- thresholds, flush, close ----------------------------------------------------------------------


def test_flush_rows_threshold_makes_multiple_shards(out: Path) -> None:
    with Store(out, flush_rows=10, flush_age_s=3600) as store:
        for batch in range(3):
            for i in range(10):
                store.append("calls", call_row(batch * 10 + i))
            assert store.sync(timeout=30)
            wait_until(lambda b=batch: store.stats["shards_written"] >= b + 1, "a shard")
        store.append("calls", call_row(99))  # below the threshold: written by close()
        assert store.sync(timeout=30)
        time.sleep(0.1)
        assert store.stats["rows_in_shards"] == 30
    assert len(list_shards(out, "calls")) == 4
    assert read_table(out, "calls").num_rows == 31


def test_flush_age_and_bytes_thresholds(out: Path) -> None:
    with Store(out, flush_age_s=0.2) as store:
        store.append("calls", call_row(1))
        wait_until(lambda: len(list_shards(out, "calls")) == 1, "the shard by age")
    with Store(out, flush_bytes=2000, flush_age_s=3600) as store:
        store.append("calls", call_row(2, request_json="x" * 3000))
        wait_until(lambda: len(list_shards(out, "calls")) == 2, "the shard by size")


def test_flush_and_close(out: Path) -> None:
    store = Store(out, flush_age_s=3600)
    assert store.start().clean
    for i in range(5):
        store.append("calls", call_row(i))
    assert store.sync(timeout=30)
    segments = list_segments(str(journal_dir(out)))
    assert len(segments) == 1 and len(read_segment(segments[0][1])[0]) == 5  # "captured"
    assert list_shards(out, "calls") == []
    assert store.flush(timeout=30)
    assert read_table(out, "calls").num_rows == 5
    store.append("calls", call_row(5))
    store.close()
    store.close()  # idempotent
    assert read_table(out, "calls").num_rows == 6
    assert list_segments(str(journal_dir(out))) == []
    assert not (journal_dir(out) / "committed").exists()
    store.append("calls", call_row(7))  # after close: dropped and counted, never raised
    assert store.stats["dropped"] == 1
    again = Store(out)
    assert again.start().clean
    again.close()


def test_append_never_raises_and_counts_bad_rows(out: Path, caplog) -> None:
    caplog.set_level(logging.ERROR)
    with Store(out) as store:
        store.append("nope", call_row(1))
        store.append("calls", ["not", "a", "dict"])  # type: ignore[arg-type]
        store.append("calls", call_row(2, request_json=object()))  # cannot be encoded
        store.append("calls", call_row(3, prompt_token_ids=["x"]))  # cannot be an int32 list
        store.append("calls", call_row(4, rollout_id=None))  # required column
        store.append("calls", call_row(5, not_a_column=1))  # ignored, warned once
        store.append("calls", call_row(6))
        assert store.flush(timeout=30)
        stats = store.stats
    assert stats["dropped"] == 3 and stats["rejected"] == 2
    assert read_table(out, "calls").column("call_id").to_pylist() == ["call-5", "call-6"]
    rejected = [r for _, r in journal_mod.iter_records(str(journal_dir(out) / "rejected.log"))]
    assert [r["call_id"] for r in rejected] == ["call-3", "call-4"]


def test_many_threads_append_concurrently(out: Path) -> None:
    threads, per_thread = 8, 400
    with Store(out, flush_rows=300) as store:

        def work(t: int) -> None:
            for i in range(per_thread):
                store.append("calls", call_row(t * per_thread + i))
                if i % 50 == 0:
                    store.append("traces", trace_row(t * per_thread + i))

        flushes: list[bool] = []

        def flusher() -> None:  # flush() and sync() from other threads meanwhile
            for _ in range(5):
                flushes.append(store.flush(timeout=30) and store.sync(timeout=30))

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        workers.append(threading.Thread(target=flusher))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert flushes == [True] * 5
        assert store.flush(timeout=30)
        assert store.stats["appended"] == threads * per_thread + threads * 8
    raw = read_table(out, "calls", dedup=False)
    assert raw.num_rows == threads * per_thread
    assert len(set(raw.column("call_id").to_pylist())) == threads * per_thread
    assert read_table(out, "traces").num_rows == threads * 8
    assert list_segments(str(journal_dir(out))) == []


def test_sync_group_commit_uses_few_fsyncs(out: Path) -> None:
    with Store(out) as store:
        for i in range(2000):
            store.append("calls", call_row(i))
        assert store.sync(timeout=30)
        assert store.stats["fsyncs"] < 200


# -- crash recovery --------------------------------------------------------------------------------

CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[3])
    from tests.test_store import call_row, trace_row
    from polar_mitm.store import Store
    store = Store(sys.argv[1], flush_age_s=3600)
    store.start()
    n = int(sys.argv[2])
    for i in range(n):
        store.append("calls", call_row(i))
        if i == n // 2:
            assert store.flush(10)  # the first half is in shards before the crash
    for i in range(5):
        store.append("traces", trace_row(i))
    assert store.sync(30)
    os._exit(9)  # no close, no atexit: like SIGKILL right after the fsync
    """
)


def crash_run(out: Path, n: int) -> None:
    repo = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(out), str(n), repo],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 9, proc.stderr


def test_crash_then_restart_recovers_exactly_once(out: Path) -> None:
    crash_run(out, 40)
    assert read_table(out, "calls").num_rows == 21  # flushed before the crash
    assert list_segments(str(journal_dir(out)))
    store = Store(out)
    report = store.start()
    assert isinstance(report, RecoveryReport)
    assert report.rows == {"calls": 19, "traces": 5}
    assert report.segments == 1  # the flushed segment was deleted before the crash
    assert not report.damaged and not report.error
    assert len(report.shards) == 2
    store.close()
    raw = read_table(out, "calls", dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(40))
    assert read_table(out, "traces").num_rows == 5
    store = Store(out)
    again = store.start()
    store.close()
    assert again.clean and again.recovered_rows == 0
    assert read_table(out, "calls", dedup=False).num_rows == 40


def test_recover_function_for_the_cli(out: Path) -> None:
    crash_run(out, 10)
    report = recover(out)
    assert report.rows["calls"] == 4 and report.rows["traces"] == 5
    assert "recovered 4 calls, 5 traces" in str(report)
    assert read_table(out, "calls", dedup=False).num_rows == 10
    assert list_segments(str(journal_dir(out))) == []


def test_torn_tail_and_garbage_are_skipped_with_one_warning(out: Path, caplog) -> None:
    jdir = journal_dir(out)
    seg1 = write_segment(jdir, 1, [("calls", call_row(i)) for i in range(5)])
    good1 = seg1.stat().st_size
    torn = frame(encode_record("calls", call_row(5)))
    with open(seg1, "ab") as f:
        f.write(torn[: len(torn) // 2])  # a crash mid-write
    seg2 = write_segment(jdir, 2, [("calls", call_row(i)) for i in range(10, 13)])
    good2 = seg2.stat().st_size
    with open(seg2, "ab") as f:
        f.write(os.urandom(3000))  # garbage
    seg3 = write_segment(jdir, 3, [("traces", trace_row(1))])
    good3 = seg3.stat().st_size
    with open(seg3, "ab") as f:
        f.write(b"\x01\x02")  # torn header
    caplog.set_level(logging.WARNING, logger="polar_mitm.store")
    store = Store(out)
    report = store.start()
    store.close()
    assert [(d.path, d.offset) for d in report.damaged] == [
        (str(seg1), good1),
        (str(seg2), good2),
        (str(seg3), good3),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for seg, off in ((seg1, good1), (seg2, good2), (seg3, good3)):
        mentions = [w for w in warnings if str(seg) in w]
        assert len(mentions) == 1 and f"offset {off}" in mentions[0]
    assert report.rows == {"calls": 8, "traces": 1}
    assert sorted(read_table(out, "calls").column("call_id").to_pylist()) == sorted(
        [f"call-{i}" for i in range(5)] + [f"call-{i}" for i in range(10, 13)]
    )


def test_read_segment_bad_crc_and_huge_length() -> None:
    payload = encode_record("calls", call_row(1))
    good = frame(payload)
    bad_crc = good[:4] + b"\0\0\0\0" + good[8:]
    import struct
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seg-00000001.log")
        with open(path, "wb") as f:
            f.write(good + bad_crc + good)
        payloads, damage = read_segment(path)
        assert payloads == [payload] and damage is not None
        assert damage.offset == len(good) and damage.reason == "crc mismatch"
        with open(path, "wb") as f:
            f.write(good + struct.pack("<II", 0xFFFFFFFF, 0) + b"x" * 10)
        payloads, damage = read_segment(path)
        assert payloads == [payload] and "implausible" in damage.reason


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    cut=st.integers(0, 10_000),
    # (eight zero bytes would be a valid empty record: length 0, crc32(b"") == 0)
    garbage=st.binary(max_size=64).filter(lambda b: not b.startswith(bytes(8))),
)
def test_any_truncation_or_garbage_yields_an_intact_prefix(sizes, cut, garbage) -> None:
    import tempfile

    payloads = [
        encode_record("calls", call_row(i, request_json="x" * n)) for i, n in enumerate(sizes)
    ]
    data = b"".join(frame(p) for p in payloads)
    data = data[: cut % (len(data) + 1)] + garbage
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seg-00000001.log")
        with open(path, "wb") as f:
            f.write(data)
        got, damage = read_segment(path)
    assert got == payloads[: len(got)]
    intact = sum(len(frame(p)) for p in got)
    assert (damage is None) == (intact == len(data))
    if damage is not None:
        assert damage.offset == intact and damage.skipped_bytes == len(data) - intact


def test_manifest_listed_segment_is_not_rewritten(out: Path) -> None:
    jdir = journal_dir(out)
    write_segment(jdir, 1, [("calls", call_row(i)) for i in range(3)])
    write_segment(jdir, 2, [("calls", call_row(3)), ("traces", trace_row(3))])
    Manifest(str(jdir)).append([(1, "calls"), (2, "calls")])  # shards exist for these
    store = Store(out)
    report = store.start()
    store.close()
    assert report.segments == 2 and report.segments_already_committed == 1
    assert report.already_committed == 4
    assert report.rows == {"calls": 0, "traces": 1}
    assert list_shards(out, "calls") == []
    assert read_table(out, "traces").num_rows == 1
    assert list_segments(str(jdir)) == [] and not (jdir / "committed").exists()


def test_recovery_dedupes_by_key(out: Path) -> None:
    jdir = journal_dir(out)
    write_segment(jdir, 1, [("calls", call_row(1)), ("traces", trace_row(1, 0))])
    write_segment(
        jdir,
        2,
        [
            ("calls", call_row(1, model_served="second copy")),
            ("traces", trace_row(1, 0)),
            ("traces", trace_row(1, 1)),
        ],
    )
    store = Store(out)
    report = store.start()
    store.close()
    assert report.duplicates == 2 and report.rows == {"calls": 1, "traces": 2}
    calls = read_table(out, "calls", dedup=False).to_pylist()
    assert [c["model_served"] for c in calls] == ["second copy"]
    traces = read_table(out, "traces")
    assert traces.num_rows == 1 and traces.to_pylist()[0]["revision"] == 1
    assert read_table(out, "traces", dedup=False).num_rows == 2


def test_new_segments_never_collide_with_the_manifest(out: Path) -> None:
    jdir = journal_dir(out)
    write_segment(jdir, 7, [("traces", trace_row(1))])
    Manifest(str(jdir)).append([(7, "calls"), (9, "calls")])
    with Store(out, flush_age_s=3600) as store:
        store.append("calls", call_row(1))
        assert store.sync(5)
        assert [n for n, _ in list_segments(str(jdir))] == [10]
    assert read_table(out, "calls").num_rows == 1 and read_table(out, "traces").num_rows == 1


def test_temp_files_are_cleaned(out: Path) -> None:
    shard_dir = out / "calls" / "date=2024-01-01"
    shard_dir.mkdir(parents=True)
    mine = shard_dir / ".part-20240101T000000000000Z-me-00000001.parquet.tmp"
    stale = shard_dir / ".part-20240101T000000000000Z-other-00000001.parquet.tmp"
    live = shard_dir / ".part-20240101T000000000000Z-busy-00000001.parquet.tmp"
    for p in (mine, stale, live):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    store = Store(out, proxy_id="me")
    report = store.start()
    store.close()
    assert sorted(report.temp_files_removed) == sorted([str(mine), str(stale)])
    assert live.exists()  # another proxy may be writing it right now
    assert read_table(out, "calls").num_rows == 0  # temp files are never read


def test_second_store_on_one_journal_is_refused(out: Path) -> None:
    with Store(out), pytest.raises(RuntimeError, match="in use"):
        Store(out).start()


def test_journal_write_failure_is_retried(out: Path, monkeypatch) -> None:
    real = journal_mod._fdatasync
    failures = iter([OSError(5, "EIO (test)")])

    def flaky(fd: int) -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        real(fd)

    monkeypatch.setattr(journal_mod, "_fdatasync", flaky)
    with Store(out) as store:
        for i in range(10):
            store.append("calls", call_row(i))
        assert store.sync(timeout=30)
        assert store.stats["journal_failures"] == 1
        assert "EIO" in store.stats["last_error"]
    raw = read_table(out, "calls", dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(10))
    assert list_segments(str(journal_dir(out))) == []


# -- remote output: upload failure -------------------------------------------------------------------


class FlakyFS(pafs.FileSystemHandler):
    """A "remote" filesystem (local files underneath) whose uploads fail while ``down`` is set."""

    def __init__(self, root: Path) -> None:
        self.local = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
        self.down = False
        self.attempts = 0
        self.fail_attempts: set[int] = set()

    def get_type_name(self) -> str:
        return "flaky"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.local.delete_dir_contents("", accept_root_dir=True)

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self.attempts += 1
        if self.down or self.attempts in self.fail_attempts:
            raise ConnectionError("bucket unreachable (test)")
        return self.local.open_output_stream(path)

    def open_append_stream(self, path, metadata):
        raise NotImplementedError

    def normalize_path(self, path):
        return path


def test_remote_output_requires_a_local_journal(tmp_path: Path) -> None:
    fs = pafs.PyFileSystem(FlakyFS(tmp_path))
    with pytest.raises(ValueError, match="journal_dir"):
        Store("bucket/prefix", filesystem=fs)


def test_upload_failure_keeps_rows_and_retries(tmp_path: Path) -> None:
    handler = FlakyFS(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    fs = pafs.PyFileSystem(handler)
    jdir = tmp_path / "journal"
    handler.down = True
    store = Store("data", journal_dir=jdir, filesystem=fs, flush_age_s=0.05)
    store.start()
    for i in range(20):
        store.append("calls", call_row(i))
    assert store.sync(timeout=30)
    assert not store.flush(timeout=1.0)
    stats = store.stats
    assert "bucket unreachable" in stats["last_error"] and stats["shard_failures"] >= 1
    assert stats["pending_rows"] == 20 and list_segments(str(jdir))
    attempts = handler.attempts
    time.sleep(0.6)
    assert handler.attempts - attempts <= 2  # backoff, not a busy loop
    handler.down = False
    assert store.flush(timeout=30)
    store.close()
    assert read_table("data", "calls", filesystem=fs).num_rows == 20
    assert list_segments(str(jdir)) == []


def test_outage_across_restart_loses_nothing(tmp_path: Path) -> None:
    handler = FlakyFS(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    fs = pafs.PyFileSystem(handler)
    jdir = tmp_path / "journal"
    handler.down = True
    store = Store("data", journal_dir=jdir, filesystem=fs)
    store.start()
    for i in range(7):
        store.append("calls", call_row(i))
    store.close(timeout=0.5)  # gives up: rows stay in the journal
    assert list_segments(str(jdir))
    report = recover("data", journal_dir=jdir, filesystem=fs)
    assert report.error and "bucket unreachable" in report.error  # still down: still kept
    assert list_segments(str(jdir))
    handler.down = False
    report = recover("data", journal_dir=jdir, filesystem=fs)
    assert report.rows["calls"] == 7 and not report.error
    assert read_table("data", "calls", filesystem=fs).num_rows == 7
    assert list_segments(str(jdir)) == []


# -- journal encoding ----------------------------------------------------------------------------


def test_token_lists_are_raw_arrays_in_the_journal_and_exact_in_parquet(out: Path) -> None:
    import random
    from array import array

    rng = random.Random(1)
    rows = [
        call_row(
            i,
            prompt_token_ids=[rng.randrange(2**31) for _ in range(300)],
            output_logprobs=[-rng.random() * 10 for _ in range(50)],
        )
        for i in range(20)
    ]
    rows[5]["prompt_token_ids"] = None
    rows[6]["prompt_token_ids"] = (1, 2, 3)  # any iterable of ints
    traces = [trace_row(1, loss_mask=[0, 1, True]), trace_row(2, loss_mask=None)]
    with Store(out, flush_age_s=3600) as store:
        for row in rows:
            store.append("calls", row)
        for row in traces:
            store.append("traces", row)
        assert store.sync(5)
        seg = list_segments(str(journal_dir(out)))[0][1]
        payloads, _ = read_segment(seg)
        _, first = journal_mod.decode_record(payloads[0])
        assert (
            isinstance(first["prompt_token_ids"], array)
            and first["prompt_token_ids"].typecode == "i"
        )
        assert first["prompt_token_ids"].tolist() == rows[0]["prompt_token_ids"]
        assert sum(len(p) for p in payloads) < 20 * (300 * 4 + 50 * 4 + 1000)  # not 5-9 bytes/token
    expected = pa.Table.from_pylist(
        [dict(r, prompt_token_ids=list(r["prompt_token_ids"] or []) or None) for r in rows],
        schema=CALLS_SCHEMA,
    )
    got = read_table(out, "calls")
    assert (
        got.column("prompt_token_ids").to_pylist()
        == expected.column("prompt_token_ids").to_pylist()
    )
    assert got.column("output_logprobs").equals(
        expected.column("output_logprobs")
    )  # same float32 rounding
    assert read_table(out, "traces").column("loss_mask").to_pylist() == [[0, 1, 1], None]


def test_plain_msgpack_lists_in_an_old_journal_still_recover(out: Path) -> None:
    jdir = journal_dir(out)
    jdir.mkdir(parents=True)
    writer = SegmentWriter(str(jdir), 1)
    writer.write_batch([frame(journal_mod.pack_record("calls", call_row(i))) for i in range(3)])
    writer.close()
    report = recover(out)
    assert report.rows["calls"] == 3
    assert read_table(out, "calls").column("prompt_token_ids").to_pylist()[2] == list(range(2, 22))


def test_out_of_range_ids_are_rejected_not_wrapped(out: Path) -> None:
    with Store(out) as store:
        store.append("calls", call_row(1, prompt_token_ids=[1, 2**31]))
        store.append("calls", call_row(2))
    assert read_table(out, "calls").column("call_id").to_pylist() == ["call-2"]
    assert [
        r["call_id"] for _, r in journal_mod.iter_records(str(journal_dir(out) / "rejected.log"))
    ] == ["call-1"]


def test_a_backlog_is_cut_into_bounded_shards(out: Path) -> None:
    jdir = journal_dir(out)
    for n in range(1, 6):
        write_segment(jdir, n, [("calls", call_row(n * 100 + i)) for i in range(40)])
    store = Store(out, flush_rows=20)
    report = store.start()
    store.close()
    assert report.rows["calls"] == 200
    sizes = [pq.read_metadata(p).num_rows for p in list_shards(out, "calls")]
    assert sizes == [40] * 5
    assert len({os.path.basename(p) for p in list_shards(out, "calls")}) == 5


def test_failure_midway_through_a_backlog_writes_nothing_twice(tmp_path: Path) -> None:
    handler = FlakyFS(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    fs = pafs.PyFileSystem(handler)
    jdir = tmp_path / "journal"
    for n in range(1, 4):
        write_segment(jdir, n, [("calls", call_row(n * 100 + i)) for i in range(10)])
    handler.fail_attempts = {2}  # the second of three shard uploads fails once
    store = Store("data", journal_dir=jdir, filesystem=fs, flush_rows=5)
    report = store.start()
    assert report.error and len(report.shards) == 1
    assert store.flush(timeout=30)
    store.close()
    raw = read_table("data", "calls", filesystem=fs, dedup=False)
    assert raw.num_rows == 30 and len(set(raw.column("call_id").to_pylist())) == 30


def test_rows_spill_to_the_journal_during_a_long_outage(tmp_path: Path) -> None:
    handler = FlakyFS(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    fs = pafs.PyFileSystem(handler)
    jdir = tmp_path / "journal"
    handler.down = True
    store = Store(
        "data", journal_dir=jdir, filesystem=fs, flush_age_s=0.05, max_pending_bytes=20_000
    )
    store.start()
    for i in range(60):
        store.append("calls", call_row(i))
        if i % 10 == 9:
            assert store.sync(5)

    def spilled() -> tuple[int] | None:
        held = sum(p.memory_bytes() for p in store._pending.values())
        return (held,) if store.stats["spills"] >= 1 and store.stats["pending_rows"] == 60 else None

    # A shard write tried while the bucket is down (one per backoff) takes the rows out of
    # `pending_rows` until it fails: wait for a moment between two tries, not a lucky instant.
    [held] = wait_until(spilled, "a spill with all 60 rows still pending")
    assert held <= 20_000 + 30_000
    handler.down = False
    assert store.flush(timeout=30)
    store.close()
    raw = read_table("data", "calls", filesystem=fs, dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(60))
    assert list_segments(str(jdir)) == []


def test_an_unreadable_segment_is_left_in_place(out: Path) -> None:
    jdir = journal_dir(out)
    write_segment(jdir, 1, [("calls", call_row(1))])
    (jdir / journal_mod.segment_name(5)).mkdir()  # reading it fails with an OSError
    store = Store(out, flush_age_s=3600)
    report = store.start()
    assert report.rows["calls"] == 1 and report.unreadable == [str(jdir / "seg-00000005.log")]
    store.append("calls", call_row(2))
    assert store.sync(5)
    assert [n for n, _ in list_segments(str(jdir))] == [5, 6]
    store.close()
    assert (jdir / "seg-00000005.log").is_dir()
    assert read_table(out, "calls").num_rows == 2


def test_close_with_no_time_left_still_journals_every_row(out: Path) -> None:
    store = Store(out, flush_age_s=3600)
    store.start()
    for i in range(300):
        store.append("calls", call_row(i))
    store.close(timeout=0)  # no time to write shards, but the queue is drained to the journal
    again = Store(out)
    again.start()
    again.close()
    raw = read_table(out, "calls", dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(300))


# -- a crash in the middle of a round of several shards ------------------------------------------

MID_ROUND_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from tests.test_store import call_row
    from polar_mitm.store import Store
    from polar_mitm.store.shards import ShardWriter

    real = ShardWriter.write
    calls = []

    def write_then_die(self, *args, **kwargs):
        if calls:
            os._exit(9)  # the second shard of the round: die before it is written
        calls.append(1)
        return real(self, *args, **kwargs)

    ShardWriter.write = write_then_die
    store = Store(sys.argv[1], flush_rows=5, flush_age_s=3600)
    store.start()
    for i in range(25):
        store.append("calls", call_row(i))
    store.flush(10)  # a round of 25 rows in pieces of 10: dies after the first piece
    os._exit(3)
    """
)


def test_crash_between_the_shards_of_one_round_writes_nothing_twice(out: Path) -> None:
    repo = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, "-c", MID_ROUND_SCRIPT, str(out), repo],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 9, proc.stderr
    assert read_table(out, "calls", dedup=False).num_rows == 10  # the first piece was published
    assert "intent calls " in (journal_dir(out) / "committed").read_text()
    report = recover(out)
    assert report.rows["calls"] == 15 and report.already_committed == 10
    raw = read_table(out, "calls", dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(25))
    assert not (journal_dir(out) / "committed").exists()  # all done: the manifest is cleared


def test_a_torn_intent_line_is_ignored(out: Path) -> None:
    jdir = journal_dir(out)
    write_segment(jdir, 1, [("calls", call_row(i)) for i in range(3)])
    (jdir / "committed").write_text(f"intent calls {out}/calls/date=2023-11-14/part-x.parq")
    report = recover(out)
    assert report.rows["calls"] == 3 and report.already_committed == 0
    assert read_table(out, "calls", dedup=False).num_rows == 3


def test_a_multi_day_flush_failing_midway_writes_no_day_twice(tmp_path: Path) -> None:
    handler = FlakyFS(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()
    fs = pafs.PyFileSystem(handler)
    handler.fail_attempts = {2}  # the second day's upload fails once
    store = Store("data", journal_dir=tmp_path / "journal", filesystem=fs, flush_age_s=3600)
    store.start()
    for i in range(6):
        store.append("calls", call_row(i, started_at=T0 + (i % 2) * DAY))
    assert store.flush(timeout=30)
    store.close()
    raw = read_table("data", "calls", filesystem=fs, dedup=False)
    assert sorted(raw.column("call_id").to_pylist()) == sorted(f"call-{i}" for i in range(6))
    assert handler.attempts == 3


# -- journaled(): the non-blocking sync ----------------------------------------------------------


def test_journaled_futures_resolve_after_the_fsync(out: Path) -> None:
    store = Store(out, flush_age_s=3600)
    early = store.journaled(store.append("calls", call_row(0)))  # before start: waits
    assert not early.done()
    store.start()
    assert early.result(timeout=30) is True
    seqs = [store.append("calls", call_row(i)) for i in range(1, 50)]
    assert seqs == list(range(2, 51))
    futures = [store.journaled(s) for s in seqs]
    assert all(f.result(timeout=30) for f in futures)
    assert store.stats["journaled"] >= 50  # resolved only once journaled
    assert store.journaled(0).result(timeout=0) is True  # a dropped row: nothing to wait for
    store.close()
    assert store.append("calls", call_row(99)) == 0  # closed: dropped, seq 0


def test_journaled_is_false_when_the_store_closes_unstarted(out: Path) -> None:
    store = Store(out)
    future = store.journaled(store.append("calls", call_row(0)))
    store.close()
    assert future.result(timeout=30) is False


def test_a_journaled_future_given_up_on_does_not_disturb_the_journal(out: Path) -> None:
    store = Store(out, flush_age_s=3600)
    cancelled = store.journaled(store.append("calls", call_row(0)))
    assert cancelled.cancel()  # what asyncio.wait_for + wrap_future do on a timeout
    store.start()
    assert store.sync(30) and store.stats["journal_failures"] == 0
    later = store.journaled(store.append("calls", call_row(1)))
    assert later.result(timeout=30) is True
    store.close()
    assert read_table(out, "calls").num_rows == 2
