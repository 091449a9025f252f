"""`polar-mitm sql`: the shards in DuckDB alone, calls with whole prompts (store/polar.sql).

Calls are stored as what each adds to an earlier call of its rollout (docs/store.md), so a
plain ``read_parquet`` gives a suffix in ``prompt_suffix_ids`` and a null ``prompt_token_ids``
for most rows. The SQL file shipped in the package defines DuckDB macros that walk
``base_call_id`` and give every call back whole; this command prints it (to ``.read`` in any
DuckDB) or runs a query with it over a directory, as views ``calls`` and ``traces``.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import click

from .captured import DataError, shard_paths

SQL_FILE = "polar.sql"


def sql_path() -> Path:
    """The macro file inside the installed package."""
    return Path(str(resources.files("polar_mitm.store").joinpath(SQL_FILE)))


def sql_text() -> str:
    return resources.files("polar_mitm.store").joinpath(SQL_FILE).read_text(encoding="utf-8")


def connect(directory: str, datasets: tuple[str, ...] = ("calls", "traces")):
    """A DuckDB connection with the macros, and views ``calls`` / ``traces`` on ``directory``
    (only those in ``datasets``: DuckDB refuses a view over files that do not exist)."""
    import duckdb

    con = duckdb.connect()
    con.execute(sql_text())
    root = directory.rstrip("/").replace("'", "''")
    for name in datasets:
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM polar_{name}('{root}')")
    return con


@click.command(short_help="DuckDB macros for whole prompts; or run a query on a directory.")
@click.argument("directory", metavar="[DIR]", required=False, type=click.Path())
@click.argument("query", required=False)
@click.option("--path", "show_path", is_flag=True, help="Print where the SQL file is, only.")
@click.option("--json", "as_json", is_flag=True, help="Print the query's rows as JSON lines.")
def sql(directory: str | None, query: str | None, show_path: bool, as_json: bool) -> None:
    """Read the shards with DuckDB alone, every prompt and request whole.

    Without arguments, print the SQL file of macros (polar_calls(root), polar_traces(root),
    polar_calls_stored(root)) to use in any DuckDB:

        polar-mitm sql > polar.sql
        duckdb -c ".read polar.sql" -c "SELECT * FROM polar_calls('polar-data')"

    With DIR and QUERY, run QUERY (needs the duckdb package) where the views ``calls`` and
    ``traces`` hold DIR's rows as polar-mitm reads them (a dataset with no shards yet has
    no view):

        polar-mitm sql polar-data "SELECT rollout_id, len(prompt_token_ids) FROM calls"
    """
    from .app import fail

    if show_path:
        click.echo(str(sql_path()))
        return
    if directory is None:
        click.echo(sql_text(), nl=False)
        return
    if query is None:
        fail('give a QUERY after the DIR (e.g. "SELECT count(*) FROM calls")')
    try:
        datasets = tuple(d for d in ("calls", "traces") if shard_paths(directory, d))
    except DataError as e:
        fail(str(e))
    if not datasets:
        fail(f"no calls or traces shards under {directory} (is it the proxy's polar_output?)")
    try:
        import duckdb
    except ImportError:
        fail(
            "polar-mitm sql DIR QUERY needs duckdb, in the readers extra: pip install 'polar-mitm[readers]'"
        )
    try:
        result = connect(directory, datasets).sql(query)
        if result is None:  # a statement without rows
            return
        if as_json:
            names = result.columns
            for row in result.fetchall():
                sys.stdout.write(json.dumps(dict(zip(names, row, strict=True)), default=str))
                sys.stdout.write("\n")
        else:
            result.show(max_rows=sys.maxsize, max_width=sys.maxsize)
    except duckdb.Error as e:
        fail(f"duckdb: {e}")
