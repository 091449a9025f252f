"""The documentation's performance tables are what polar_bench renders from the saved runs (issue
45): none typed by hand, none stale, every saved run shown (docs/performance.md and the design
notes that show their own scenario's tables)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from polar_bench import render
from tests.helpers import ROOT

DOC = ROOT / "docs" / "performance.md"
RUNS = ROOT / "polar_bench" / "runs"


def test_every_page_is_what_its_runs_render() -> None:
    pages = render.pages()
    assert DOC in pages and len(pages) > 1
    for page in pages:
        text = page.read_text()
        assert render.render(text) == text, f"python -m polar_bench render, then commit {page}"


def test_every_saved_run_has_its_table() -> None:
    named = {
        name
        for page in render.pages()
        for name in re.findall(r"<!-- polar_bench: runs/([\w.-]+) -->", page.read_text())
    }
    saved = {p.name for p in RUNS.glob("*.json")}
    assert saved and named == saved
    for name in saved:  # each names where and with what it was measured
        run = json.loads((RUNS / name).read_text())
        assert run["machine"]["cpus"] > 0 and run["machine"]["versions"]["polar-mitm"], name


def _copy(tmp_path: Path, doc: str) -> Path:
    """A checkout's polar_bench runs and a page, under tmp_path, for render.main(--doc)."""
    path = tmp_path / "performance.md"
    path.write_text(doc)
    return path


def test_a_hand_edited_table_is_found(tmp_path: Path, capsys) -> None:
    text = DOC.read_text()
    body = text.split("<!-- /polar_bench -->")[0]
    last = body.rstrip().rsplit("\n", 1)[1]  # the first table's last row
    edited = text.replace(last, last.replace("|", "| 1 |", 1), 1)
    assert edited != text
    assert render.main(["--check", "--doc", str(_copy(tmp_path, edited))]) == 1
    assert "not what its run renders" in capsys.readouterr().out
    page = _copy(tmp_path, edited)
    assert render.main(["--doc", str(page)]) == 0 and page.read_text() == text  # and put back


def test_a_marker_without_its_run_is_one_line(tmp_path: Path, capsys) -> None:
    page = _copy(tmp_path, "<!-- polar_bench: runs/nope.json -->\n<!-- /polar_bench -->\n")
    assert render.main(["--check", "--doc", str(page)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read the run runs/nope.json") and err.count("\n") == 1
    shutil.rmtree(tmp_path)
