"""Calls stored as what they add to the rollout's previous call (store/delta.py, schema 3).

Real Stores in tmp_path: rows go through the journal thread's encoder into real Parquet shards,
and come back whole through `store.read_table` and the CLI's `captured.read`; a crash in a child
process replays encoded rows from the journal; schema-1 and schema-2 shards (and a schema-2
journal) still read, and `polar-mitm migrate` rewrites them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.cli import captured
from polar_mitm.store import CALLS_SCHEMA, SCHEMA_VERSION, Store, list_shards, read_table
from polar_mitm.store.delta import DELTA_COLUMNS, PARTS, resolve, shared_ends

TOOLS = [
    {"type": "function", "function": {"name": f"t{i}", "description": "x" * 300}} for i in range(3)
]


def session(rollout: str, turns: int, seed: int, context: int = 2000) -> list[dict]:
    """A rollout as an agent harness makes it: every call re-sends the conversation so far (its
    prompt the last prompt + the last output + a tool result; its request the messages + tools)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(151_000) for _ in range(context)]
    messages = [{"role": "system", "content": "s" * 4000}, {"role": "user", "content": "go"}]
    rows = []
    for t in range(turns):
        output = [rng.randrange(151_000) for _ in range(30)]
        body = {"model": "m", "messages": messages, "tools": TOOLS, "stream": True}
        rows.append(
            {
                "call_id": f"{rollout}-{t}",
                "rollout_id": rollout,
                "started_at": 1_700_000_000_000_000 + t,
                "prompt_token_ids": list(prompt),
                "output_token_ids": output,
                "output_logprobs": [-0.5] * len(output),
                "request_json": json.dumps(body, separators=(",", ":")),
                "status": "completed",
            }
        )
        result = [rng.randrange(151_000) for _ in range(500)]
        prompt = prompt + output + result
        messages = [
            *messages,
            {"role": "assistant", "content": f"turn {t}"},
            {"role": "tool", "content": "r" * 2000 + str(t)},
        ]
    return rows


def stored_rows(out: Path) -> dict[str, dict]:
    """Every stored row by call id, as a plain Parquet reader sees it (not resolved)."""
    return {
        r["call_id"]: r
        for path in list_shards(out, "calls")
        for r in pq.read_table(path).to_pylist()
    }


def stored_sizes(out: Path) -> tuple[int, int]:
    """Ids and request characters in the shards as stored (not resolved)."""
    ids = chars = 0
    for r in stored_rows(out).values():
        ids += len(r["prompt_token_ids"] or ()) + len(r["prompt_suffix_ids"] or ())
        chars += len(r["request_json"] or "") + len(r["request_middle"] or "")
    return ids, chars


def assert_no_part_under_a_whole_name(out: Path, rows: list[dict]) -> int:
    """What a reader without polar-mitm gets under the whole columns' names is whole or null;
    returns how many rows hold a part (so a caller can insist the encoding was exercised)."""
    truth = {r["call_id"]: r for r in rows}
    parts = 0
    for call_id, r in stored_rows(out).items():
        for whole, (part, length) in PARTS.items():
            assert r[whole] is None or r[whole] == truth[call_id][whole], (call_id, whole)
            assert (r[whole] is None) == (r[length] is not None) == (r[part] is not None)
            parts += r[part] is not None
    return parts


def migrate(out: Path) -> subprocess.CompletedProcess:
    """`polar-mitm migrate OUT` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "polar_mitm.cli.app", "migrate", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def as_schema_2(table: pa.Table) -> pa.Table:
    """A shard as schema 2 wrote it: the parts under the whole columns' names."""
    for whole, (part, length) in PARTS.items():
        kept = pa.compute.is_valid(table.column(length))
        moved = pa.compute.if_else(kept, table.column(part), table.column(whole))
        table = table.set_column(table.column_names.index(whole), whole, moved)
        table = table.drop_columns([part])
    return table.replace_schema_metadata({"schema_version": "2"})


def interleaved(*rollouts: list[dict]) -> list[dict]:
    return [row for turn in zip(*rollouts, strict=True) for row in turn]


def test_a_long_rollout_is_stored_linear_and_read_back_whole(tmp_path: Path) -> None:
    rows = interleaved(session("a", 12, 1), session("b", 12, 2))
    with Store(tmp_path, flush_rows=5) as store:  # several shards: bases in earlier ones
        for row in rows:
            store.append("calls", row)
    assert len(list_shards(tmp_path, "calls")) >= 3
    ids, chars = stored_sizes(tmp_path)
    whole_ids = sum(len(r["prompt_token_ids"]) for r in rows)
    whole_chars = sum(len(r["request_json"]) for r in rows)
    # each rollout's first prompt whole, then only what each call adds (output + tool result)
    assert ids == 2 * (2000 + 11 * 500), (ids, whole_ids)
    assert chars < whole_chars / 4, (chars, whole_chars)
    assert assert_no_part_under_a_whole_name(tmp_path, rows) == 2 * 2 * 11
    table = read_table(tmp_path, "calls")
    back = {r["call_id"]: r for r in table.to_pylist()}
    for row in rows:
        assert back[row["call_id"]]["prompt_token_ids"] == row["prompt_token_ids"]
        assert back[row["call_id"]]["request_json"] == row["request_json"]
        assert all(back[row["call_id"]][c] is None for c in DELTA_COLUMNS)
    # the CLI's reader: a column subset and one rollout's rows, pushed down into the scan
    few = captured.read(
        str(tmp_path), "calls", ["rollout_id", "prompt_token_ids"], progress=False, rollout="b"
    )
    assert few.column_names == ["call_id", "rollout_id", "prompt_token_ids"]
    want = [r["prompt_token_ids"] for r in rows if r["rollout_id"] == "b"]
    assert few.column("prompt_token_ids").to_pylist() == want


def test_a_prompt_that_does_not_extend_the_last_call_is_stored_whole(tmp_path: Path) -> None:
    rows = session("a", 3, 1)
    rows.append({**session("a", 1, 99)[0], "call_id": "a-new"})  # a new conversation, same rollout
    with Store(tmp_path) as store:
        for row in rows:
            store.append("calls", row)
    stored = stored_rows(tmp_path)
    assert stored["a-new"]["prompt_base_len"] is None
    assert len(stored["a-new"]["prompt_token_ids"]) == 2000
    assert stored["a-1"]["base_call_id"] == "a-0" and stored["a-1"]["prompt_base_len"] == 2030
    back = {r["call_id"]: r for r in read_table(tmp_path, "calls").to_pylist()}
    assert [back[r["call_id"]]["prompt_token_ids"] for r in rows] == [
        r["prompt_token_ids"] for r in rows
    ]


def test_the_merge_names_the_base_and_the_encoder_keeps_no_ids(tmp_path: Path) -> None:
    """Rows from the proxy: records merged by the real `Rollouts` carry the merge's base
    (`Placement.base`), so the encoder slices without a copy of the rollout's ids, also across
    chains (a break's base is its parent chain's last call). A base not yet journaled (the
    fidelity worker can finish calls out of order) means the row is stored whole."""
    from polar_mitm.core.record import CallRecord
    from polar_mitm.store.delta import DELTA_BASE, PromptDelta
    from polar_mitm.trajectory.rollouts import Rollouts

    rows = session("a", 4, 1)
    branch = {**rows[2], "call_id": "a-branch"}  # turn 2 again, another reply: a new chain
    branch["prompt_token_ids"] = rows[2]["prompt_token_ids"][:-200] + [7] * 300
    rollouts = Rollouts(lambda rows: None)
    records = []
    for row in [*rows, branch]:
        record = CallRecord(**{k: v for k, v in row.items()})
        record.status = "completed"
        rollouts.call_finished(record)
        records.append(record)
    bases = {r.call_id: r.delta_base for r in records}
    assert bases["a-0"] is None
    assert bases["a-1"][:2] == ("a-0", 2030) and bases["a-3"][:2] == ("a-2", 2000 + 2 * 530 + 30)
    assert bases["a-branch"][0] == "a-3"  # the main chain's last call holds the shared prefix
    out_of_order = [records[0], records[2], records[1], records[3], records[4]]
    with Store(tmp_path) as store:
        for record in out_of_order:
            store.append("calls", record.to_row())
    stored = stored_rows(tmp_path)
    assert stored["a-2"]["base_call_id"] is None  # its base a-1 came after it: stored whole
    assert stored["a-1"]["base_call_id"] == "a-0" and stored["a-3"]["base_call_id"] == "a-2"
    assert stored["a-branch"]["base_call_id"] == "a-3"
    assert len(stored["a-branch"]["prompt_suffix_ids"]) == 300
    assert stored["a-branch"]["prompt_token_ids"] is None
    back = {r["call_id"]: r for r in read_table(tmp_path, "calls").to_pylist()}
    for row in [*rows, branch]:
        assert back[row["call_id"]]["prompt_token_ids"] == row["prompt_token_ids"]
        assert back[row["call_id"]]["request_json"] == row["request_json"]
    from polar_mitm.store.journal import prepare_row

    hinted, plain = PromptDelta(), PromptDelta()  # what each holds of the rollout
    for record in records:
        row = prepare_row("calls", record.to_row())
        assert (DELTA_BASE in row) == (record.delta_base is not None)
        assert DELTA_BASE not in hinted.encode("calls", row)  # what the journal gets
        plain.encode("calls", {k: v for k, v in row.items() if k != DELTA_BASE})
    assert hinted._seen["a"].last[1] is None  # the merge's chain has the ids
    assert len(plain._seen["a"].last[1]) == len(branch["prompt_token_ids"]) + 30


def test_a_missing_base_reads_back_null_with_a_warning(tmp_path: Path, caplog) -> None:
    rows = session("a", 3, 1)
    with Store(tmp_path) as store:
        for row in rows:
            store.append("calls", row)
    [path] = list_shards(tmp_path, "calls")
    table = pq.read_table(path)
    without_first = table.filter(pa.compute.not_equal(table.column("call_id"), "a-0"))
    with caplog.at_level(logging.WARNING, logger="polar_mitm.store"):
        back = resolve(without_first.select(CALLS_SCHEMA.names)).to_pylist()
    assert [r["prompt_token_ids"] for r in back] == [None, None]
    assert [r["request_json"] for r in back] == [None, None]
    assert "call a-1 extends call a-0, which is not in the shards read" in caplog.text


def test_a_schema_1_shard_reads_as_before(tmp_path: Path) -> None:
    rows = session("a", 3, 1)
    old = pa.schema([f for f in CALLS_SCHEMA if f.name not in DELTA_COLUMNS])
    folder = tmp_path / "calls" / "date=2023-11-14"
    folder.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=old).replace_schema_metadata({"schema_version": "1"}),
        folder / "part-20231114T000000Z-old-00000001.parquet",
    )
    back = read_table(tmp_path, "calls").to_pylist()
    assert [r["prompt_token_ids"] for r in back] == [r["prompt_token_ids"] for r in rows]


def test_schema_2_shards_read_whole_and_migrate_to_parts_under_their_own_names(
    tmp_path: Path,
) -> None:
    """A directory of shards written by schema 2 (the parts under prompt_token_ids and
    request_json): the store's reader and the CLI's give whole prompts as before; `migrate`
    moves the parts to their own columns, changing nothing a polar-mitm reader returns."""
    rows = interleaved(session("a", 5, 1), session("b", 5, 2))
    with Store(tmp_path, flush_rows=4) as store:
        for row in rows:
            store.append("calls", row)
    for path in list_shards(tmp_path, "calls"):
        pq.write_table(as_schema_2(pq.read_table(path)), path)
    old = stored_rows(tmp_path)
    assert "prompt_suffix_ids" not in old["a-1"]
    assert old["a-1"]["prompt_base_len"] and len(old["a-1"]["prompt_token_ids"]) == 500
    back = read_table(tmp_path, "calls").to_pylist()
    assert [r["prompt_token_ids"] for r in back] == [r["prompt_token_ids"] for r in rows]
    assert [r["request_json"] for r in back] == [r["request_json"] for r in rows]
    few = captured.read(
        str(tmp_path), "calls", ["prompt_token_ids", "request_json"], progress=False
    )
    assert few.column("prompt_token_ids").to_pylist() == [r["prompt_token_ids"] for r in rows]
    assert few.column("request_json").to_pylist() == [r["request_json"] for r in rows]
    proc = migrate(tmp_path)
    assert proc.returncode == 0, proc.stderr
    shards = len(list_shards(tmp_path, "calls"))
    assert f"migrated {shards} calls shards ({len(rows)} rows) to schema 3" in proc.stdout
    assert assert_no_part_under_a_whole_name(tmp_path, rows) == 2 * 2 * 4
    for path in list_shards(tmp_path, "calls"):
        meta = pq.read_schema(path).metadata
        assert meta[b"schema_version"] == b"3" and meta[b"polar_migrated_from"] == b"2"
    assert read_table(tmp_path, "calls").to_pylist() == back


CRASH = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from tests.test_store_delta import session
    from polar_mitm.store import Store, delta
    if sys.argv[3] == "2":  # journal as schema 2's proxy did: the parts under the whole names
        encode = delta.PromptDelta.encode
        def encode_2(self, dataset, row):
            row = dict(encode(self, dataset, row))
            for whole, (part, _) in delta.PARTS.items():
                if row.get(part) is not None:
                    row[whole] = row.pop(part)
            return row
        delta.PromptDelta.encode = encode_2
    store = Store(sys.argv[1], flush_age_s=3600)
    store.start()
    for row in session("a", 6, 1):
        store.append("calls", row)
    assert store.sync(10)
    os._exit(9)  # journaled (encoded), never in a shard
    """
)


@pytest.mark.parametrize("journal_schema", ["3", "2"])
def test_encoded_rows_replayed_from_the_journal_read_back_whole(
    tmp_path: Path, journal_schema: str
) -> None:
    """A crash leaves encoded rows in the journal; the next start writes them to shards in the
    current form, also when the journal was written by schema 2's proxy (an upgrade after a
    crash): no part lands under a whole column's name."""
    repo = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path), repo, journal_schema],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": repo},
    )
    assert proc.returncode == 9, proc.stderr
    assert not list_shards(tmp_path, "calls")
    with Store(tmp_path) as store:
        assert store.stats["appended"] == 0
    assert stored_sizes(tmp_path)[0] == 2000 + 5 * 500  # replayed as journaled: encoded
    assert assert_no_part_under_a_whole_name(tmp_path, session("a", 6, 1)) == 2 * 5
    back = read_table(tmp_path, "calls").to_pylist()
    assert [r["prompt_token_ids"] for r in back] == [
        r["prompt_token_ids"] for r in session("a", 6, 1)
    ]


@settings(max_examples=60, deadline=None)
@given(st.text("ab{}", max_size=40), st.text("ab{}", max_size=40))
def test_shared_ends_never_overlap_and_rebuild(a: str, b: str) -> None:
    p, q = shared_ends(a, b)
    assert p + q <= min(len(a), len(b))
    assert a[:p] == b[:p] and a[len(a) - q :] == b[len(b) - q :]
    assert a[:p] + b[p : len(b) - q] + a[len(a) - q :] == b


def test_migrate_rewrites_schema_1_shards_smaller_and_reads_the_same(tmp_path: Path) -> None:
    rows = interleaved(session("a", 8, 1), session("b", 8, 2))
    old = pa.schema([f for f in CALLS_SCHEMA if f.name not in DELTA_COLUMNS])
    folder = tmp_path / "calls" / "date=2023-11-14"
    folder.mkdir(parents=True)
    for n, part in enumerate((rows[:6], rows[6:], rows[6:8])):  # the last: a crash's duplicates
        table = pa.Table.from_pylist(part, schema=old)
        pq.write_table(
            table.replace_schema_metadata({"schema_version": "1"}),
            folder / f"part-20231114T00000{n}Z-old-0000000{n}.parquet",
            compression="zstd",
        )
    before = read_table(tmp_path, "calls").to_pylist()
    proc = migrate(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"migrated 3 calls shards (18 rows) to schema {SCHEMA_VERSION}" in proc.stdout
    assert read_table(tmp_path, "calls").to_pylist() == before
    assert assert_no_part_under_a_whole_name(tmp_path, rows) > 0
    assert stored_sizes(tmp_path)[0] < sum(len(r["prompt_token_ids"]) for r in rows) / 3
    again = migrate(tmp_path)
    assert f"nothing to migrate (3 calls shards already schema {SCHEMA_VERSION})" in again.stdout
    with Store(tmp_path):  # a running proxy holds the lock: migrate refuses
        busy = migrate(tmp_path)
    assert busy.returncode == 1 and "in use by another polar-mitm store" in busy.stderr
