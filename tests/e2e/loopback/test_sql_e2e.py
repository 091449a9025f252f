"""DuckDB alone reads the shards a real session left (tests/helpers/capture_session.py: the
reference policy server, mitmdump with the addon, HTTPS through the proxy) as polar-mitm's own
reader does.

Calls are stored as what each adds to an earlier call of its rollout (docs/store.md), so the
whole prompts and requests come back only by walking ``base_call_id``: the SQL file shipped in
the package (``polar_mitm/store/polar.sql``) does it in DuckDB; here it runs with no polar-mitm
code touching the shards, and every row must equal `store.read_table`'s. The same on the shards
rewritten as schema 2 wrote them, and after `polar-mitm migrate` turned those back into schema 3.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.store import CALLS_SCHEMA, TRACES_SCHEMA, list_shards, read_table
from polar_mitm.store.delta import DELTA_COLUMNS
from tests.helpers import ROOT
from tests.helpers.capture_session import produce
from tests.helpers.procs import BIN
from tests.test_store_delta import as_schema_2

duckdb = pytest.importorskip("duckdb")

POLAR = str(BIN / "polar-mitm")
SQL_FILE = ROOT / "polar_mitm" / "store" / "polar.sql"
WHOLE_COLUMNS = [n for n in CALLS_SCHEMA.names if n not in DELTA_COLUMNS]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, confdir: Path) -> Path:
    return produce(tmp_path_factory.mktemp("sql-session"), confdir).output


def duckdb_rows(output: Path, macro: str, columns: list[str]) -> list[dict]:
    """``macro``'s rows, read by DuckDB alone with the shipped SQL file."""
    con = duckdb.connect()
    con.execute(SQL_FILE.read_text(encoding="utf-8"))
    select = ", ".join(f'"{c}"' for c in columns)
    root = str(output).replace("'", "''")
    result = con.sql(f"SELECT {select} FROM {macro}('{root}')")
    # DuckDB 2 names it to_arrow_table; 1.x returns the table from arrow()
    return (getattr(result, "to_arrow_table", None) or result.arrow)().to_pylist()


def parts_stored(output: Path) -> int:
    """Calls stored as a part (a suffix of ids or the middle of a request), as on disk."""
    n = 0
    for path in list_shards(output, "calls"):
        t = pq.read_table(path)
        n += sum(
            len(t) - t.column(c).null_count for c in ("prompt_base_len", "request_base_prefix")
        )
    return n


def split_shards(output: Path, n: int) -> None:
    """Each calls shard as `n` shards of consecutive rows, named so they read in the same order."""
    for path in list_shards(str(output), "calls"):
        table = pq.read_table(path)
        Path(path).unlink()
        step = -(-len(table) // n)
        for i in range(n):
            part = table.slice(i * step, step)
            pq.write_table(part, path.replace(".parquet", f"-{i}.parquet"))


def assert_duckdb_reads_as_the_store(output: Path) -> None:
    calls = read_table(str(output), "calls").select(WHOLE_COLUMNS).to_pylist()
    assert duckdb_rows(output, "polar_calls", WHOLE_COLUMNS) == calls
    traces = read_table(str(output), "traces").to_pylist()
    assert duckdb_rows(output, "polar_traces", TRACES_SCHEMA.names) == traces


def test_duckdb_alone_gives_every_call_whole_as_the_store_reader_does(
    data: Path, tmp_path: Path
) -> None:
    calls = read_table(str(data), "calls").to_pylist()
    # the tool loops: later calls stored as parts (20 prompt or request parts, 21 calls, one run)
    assert parts_stored(data) >= 8
    assert sum(c["prompt_token_ids"] is not None for c in calls) >= len(calls) - 1
    assert_duckdb_reads_as_the_store(data)
    # a plain read of the stored rows: a whole column is whole or null, never a part
    whole = {c["call_id"]: c for c in calls}
    plain = duckdb.connect().execute(
        "SELECT call_id, prompt_token_ids, request_json, prompt_suffix_ids, request_middle "
        "FROM read_parquet(?, union_by_name = true)",
        [f"{data}/calls/**/part-*.parquet"],
    )
    for call_id, prompt, request, suffix, middle in plain.fetchall():
        assert prompt is None or prompt == whole[call_id]["prompt_token_ids"], call_id
        assert request is None or request == whole[call_id]["request_json"], call_id
        if whole[call_id]["prompt_token_ids"] is not None:  # a call without ids stores none
            assert (prompt is None) == (suffix is not None), call_id
        assert (request is None) == (middle is not None)

    # the same rows in four shards (bases in earlier ones), every other one as schema 2 stored
    # it (parts under the whole names: a proxy upgraded mid-run), then migrated
    old = tmp_path / "old"
    shutil.copytree(data, old, ignore=shutil.ignore_patterns("_journal"))
    split_shards(old, 4)
    paths = list_shards(str(old), "calls")
    assert len(paths) >= 4
    for path in paths[::2]:
        pq.write_table(as_schema_2(pq.read_table(path)), path)
    assert parts_stored(old) == parts_stored(data)
    assert_duckdb_reads_as_the_store(old)
    assert read_table(str(old), "calls").to_pylist() == read_table(str(data), "calls").to_pylist()
    migrated = subprocess.run(
        [POLAR, "migrate", str(old)], capture_output=True, text=True, timeout=120
    )
    assert migrated.returncode == 0 and "to schema 3" in migrated.stdout, migrated.stderr
    assert_duckdb_reads_as_the_store(old)
    assert read_table(str(old), "calls").to_pylist() == read_table(str(data), "calls").to_pylist()


def test_polar_mitm_sql_prints_the_macros_and_runs_a_query(data: Path, tmp_path: Path) -> None:
    printed = subprocess.run([POLAR, "sql"], capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and printed.stdout == SQL_FILE.read_text(encoding="utf-8")
    where = subprocess.run([POLAR, "sql", "--path"], capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).read_text(encoding="utf-8") == printed.stdout
    calls = read_table(str(data), "calls").to_pylist()
    query = (
        "SELECT rollout_id, count(*) AS calls, sum(len(prompt_token_ids)) AS prompt_ids, "
        "sum(length(request_json)) AS request_chars FROM calls GROUP BY rollout_id"
    )
    ran = subprocess.run(
        [POLAR, "sql", str(data), query, "--json"], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    got = {r["rollout_id"]: r for r in map(json.loads, ran.stdout.splitlines())}
    assert set(got) == {c["rollout_id"] for c in calls}
    for rollout, row in got.items():
        mine = [c for c in calls if c["rollout_id"] == rollout]
        assert row["calls"] == len(mine)
        assert row["prompt_ids"] == sum(len(c["prompt_token_ids"] or ()) for c in mine)
        assert row["request_chars"] == sum(len(c["request_json"] or "") for c in mine)
    table = subprocess.run(
        [POLAR, "sql", str(data), "SELECT count(*) AS n FROM traces"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0 and str(len(read_table(str(data), "traces"))) in table.stdout
    bad = subprocess.run(
        [POLAR, "sql", str(data), "SELECT nope FROM calls"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error: duckdb: ")
    missing = subprocess.run(
        [POLAR, "sql", str(data / "nowhere"), "SELECT 1"], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    # calls written, no trace yet (no rollout ended): the calls view alone
    shutil.copytree(data / "calls", tmp_path / "early" / "calls")
    early = subprocess.run(
        [POLAR, "sql", str(tmp_path / "early"), "SELECT count(*) AS n FROM calls", "--json"],
        capture_output=True,
        text=True,
    )
    assert early.returncode == 0, early.stderr
    assert json.loads(early.stdout) == {"n": len(calls)}
    (tmp_path / "empty").mkdir()
    empty = subprocess.run(
        [POLAR, "sql", str(tmp_path / "empty"), "SELECT 1"], capture_output=True, text=True
    )
    assert empty.returncode == 1 and "no calls or traces shards under" in empty.stderr
