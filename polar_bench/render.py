"""The documentation's performance tables, rendered from the saved runs in polar_bench/runs/.

    python -m polar_bench render            # rewrite the tables in every page of docs/
    python -m polar_bench render --check    # exit 1 if a table is not what its run renders
    python -m polar_bench render --doc F    # one page only

docs/performance.md holds most of them; a design note (docs/fidelity.md, docs/store.md ...)
shows the tables of its own scenario the same way. A table in a page sits between two markers
naming its run:

    <!-- polar_bench: runs/long-quick.json -->
    ...what this module renders from that file...
    <!-- /polar_bench -->

Everything else in the page (the narrative) is left as written. A run is the JSON a scenario's
``--json`` wrote (core.save: the scenario, its arguments, when, the machine and the versions,
the figures): a short-chat run renders as markdown.py's table, goals judged; a long, vllm or farm
run as its scenario's report of the saved figures; any other as the rows its scenario printed
(``header`` and ``table``). So no table in the page is typed by hand,
and ``--check`` (a test runs it) says when one was.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .markdown import markdown

PACKAGE = Path(__file__).resolve().parent
DOCS = PACKAGE.parent / "docs"
DOC = DOCS / "performance.md"
BLOCK = re.compile(
    r"(<!-- polar_bench: (?P<run>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /polar_bench -->)", re.S
)


class RenderError(Exception):
    """A marker names a run that is missing or not a run: the one line said to the user."""


def provenance(run: dict, name: str) -> str:
    """The line above a table: what was run, when, on what."""
    m = run.get("machine", {})
    versions = m.get("versions", {})
    named = ", ".join(f"{k} {versions[k]}" for k in ("polar-mitm", "mitmproxy") if k in versions)
    command = " ".join(["python -m polar_bench", run["scenario"], *run.get("argv", [])])
    end = f", {m['load_avg_1m_end']:.1f} at the end" if "load_avg_1m_end" in m else ""
    return (
        f"`{command}` ({name}), measured {run.get('measured_at', '?')} on {m.get('cpu', '?')}, "
        f"{m.get('cpus', '?')} CPUs, load average {m.get('load_avg_1m', float('nan')):.1f} at "
        f"the start{end}; Python {m.get('python', '?')}, {named}."
    )


def rows_of(run: dict) -> tuple[tuple[str, ...] | None, list | None]:
    """A run's header and rows: its scenario's report of its figures, as the scenario prints it
    today (so a report's fix shows on every saved run), else the rows the run saved."""
    from . import core, exact, farm, fidelity, long, vllm

    reports = {
        "long": (long.HEADER, long.report_long),
        "farm": (farm.HEADER, farm.report_farm),
        "vllm": (vllm.HEADER, vllm.report_vllm),
    }
    if run["scenario"] in reports:
        header, report = reports[run["scenario"]]
        return header, report(run)
    labels = {"exact": exact.LABELS, "fidelity": fidelity.LABELS}
    if run["scenario"] in labels and "figures" in run:  # a row a figure, named as today
        return core.FIGURE_HEADER, core.figure_rows(run["figures"], labels[run["scenario"]])
    return run.get("header"), run.get("table")


def table(run: dict) -> str:
    """A run's figures as a Markdown table."""
    if run["scenario"] == "chat":
        return markdown(run)
    header, rows = rows_of(run)
    if not header or rows is None:
        raise RenderError(f"a {run['scenario']} run without header and table rows")

    def cells(row: list) -> str:  # a "|" inside a cell would split it
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |"

    lines = [cells(header), "|" + " --- |" * len(header), *(cells(row) for row in rows)]
    return "\n".join(lines)


def load(name: str) -> dict:
    path = PACKAGE / name
    try:
        run = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RenderError(f"cannot read the run {name}: {e}") from None
    if not isinstance(run, dict) or "scenario" not in run:
        raise RenderError(f"{name} is not a polar_bench run (no scenario)")
    return run


def render(text: str) -> str:
    """The page with every marked table rendered again from its run."""

    def one(m: re.Match) -> str:
        run = load(m["run"])
        return f"{m[1]}{provenance(run, m['run'])}\n\n{table(run)}\n{m[4]}"

    return BLOCK.sub(one, text)


def pages() -> list[Path]:
    """The pages of docs/ that show a saved run's table."""
    return sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is out of date")
    ap.add_argument("--doc", type=Path, default=None, help="one page (default: all of docs/)")
    args = ap.parse_args(argv)
    stale = 0
    for doc in [args.doc] if args.doc else pages():
        try:
            text = doc.read_text()
            new = render(text)
        except (OSError, RenderError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if new == text:
            continue
        if args.check:
            print(f"{doc}: a table is not what its run renders (python -m polar_bench render)")
            stale += 1
        else:
            doc.write_text(new)
            print(f"rewrote {doc}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
