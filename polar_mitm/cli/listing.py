"""How the listing commands (`summary`, `calls`, `fidelity`) print a table, wherever it goes.

A `Listing` is a title, columns and rows of strings. Three ways out:

- a terminal (or ``COLUMNS`` set): a rich table that fits the width. Ids and numbers are never cut
  or folded: their columns are as wide as their longest value, and when the table does not fit,
  whole columns are left out (each listing says which go first; ``--json`` has every figure)
  before any free text (errors, flag lists) wraps. A table whose essential columns alone are
  wider than the terminal is printed at that width: the terminal wraps it, no id is shortened;
- not a terminal (a pipe, a CI log, ``kubectl exec`` without a TTY) and no ``COLUMNS``: the whole
  table at its natural width, so ``polar-mitm summary DIR | grep ROLLOUT`` finds whole lines;
- ``--plain``: tab-separated lines, a header of column names and one line per row (no title, no
  totals), for ``cut``/``awk``/spreadsheets.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

# wider than any listing: the natural width of a table printed to a pipe
_UNLIMITED = 100_000


@dataclass(frozen=True, slots=True)
class Column:
    """``wraps``: free text that may wrap on a narrow terminal (every other column is an id or a
    figure, shown whole). ``drop``: the order in which columns are left out when the terminal is
    too narrow (1 goes first); 0 is never left out."""

    name: str
    numeric: bool = False
    wraps: bool = False
    drop: int = 0


@dataclass(slots=True)
class Listing:
    title: str
    columns: Sequence[Column]
    rows: list[list[str]] = field(default_factory=list)
    totals: list[list[str]] = field(default_factory=list)  # after a rule; not in --plain

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def plain(self) -> str:
        """Tab-separated: the header, then the rows (tabs and newlines in a cell become spaces)."""
        lines = ["\t".join(c.name for c in self.columns)]
        lines += ["\t".join(" ".join(cell.split()) for cell in row) for row in self.rows]
        return "\n".join(lines) + "\n"

    def table(self, width: int | None, console: Console) -> tuple[Table, int]:
        """The rich table for ``width`` columns (None: natural width), and the width to print it
        at (more than ``width`` only when its essential columns alone do not fit).

        Every column gets an explicit width, so rich never shrinks one itself: ids and figures
        are as wide as their longest value, free text no narrower than its longest word."""
        every = [[c.name for c in self.columns], *self.rows, *self.totals]
        natural = [max(cell_len(r[i]) for r in every) for i in range(len(self.columns))]
        least = [
            max(max((cell_len(w) for w in r[i].split()), default=1) for r in every)
            if c.wraps
            else natural[i]
            for i, c in enumerate(self.columns)
        ]
        keep = list(range(len(self.columns)))
        if width is None:
            return self._build(keep, natural), _UNLIMITED
        extra = self._extra(console, keep, natural)
        for index in sorted(
            (i for i, c in enumerate(self.columns) if c.drop), key=lambda i: self.columns[i].drop
        ):
            if sum(least[i] for i in keep) + extra <= width:
                break
            keep.remove(index)
            extra = self._extra(console, keep, natural)
        widths = list(natural)
        excess = sum(widths[i] for i in keep) + extra - width
        while excess > 0:  # narrow the widest free text first, never below its longest word
            slack = [i for i in keep if widths[i] > least[i]]
            if not slack:
                break
            widest = max(slack, key=lambda i: widths[i])
            widths[widest] -= 1
            excess -= 1
        table = self._build(keep, widths)
        return table, max(width, sum(widths[i] for i in keep) + extra)

    def _extra(self, console: Console, keep: Sequence[int], widths: Sequence[int]) -> int:
        """What the table adds to its columns' widths (padding, edges) for these columns."""
        table = self._build(keep, widths)
        return _measure(console, table) - sum(widths[i] for i in keep)

    def _build(self, keep: Sequence[int], widths: Sequence[int]) -> Table:
        table = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i in keep:
            col = self.columns[i]
            table.add_column(
                col.name,
                justify="right" if col.numeric else "left",
                no_wrap=not col.wraps,
                overflow="fold",
                width=widths[i],
            )
        for row in self.rows:
            table.add_row(*(row[i] for i in keep))
        if self.totals:
            table.add_section()
            for row in self.totals:
                table.add_row(*(row[i] for i in keep))
        return table


def _measure(console: Console, table: Table) -> int:
    return Measurement.get(console, console.options.update_width(_UNLIMITED), table).maximum


def terminal_width(console: Console) -> int | None:
    """The width to fit tables to: the terminal's, or ``COLUMNS``; None for a pipe (natural)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return console.width if console.is_terminal else None


def emit(listings: Sequence[Listing], plain: bool = False, console: Console | None = None) -> None:
    """Print listings as a terminal, a pipe or ``--plain`` wants them (see the module doc)."""
    if plain:
        sys.stdout.write("\n".join(listing.plain() for listing in listings))
        sys.stdout.flush()
        return
    console = console or Console()
    width = terminal_width(console)
    screen = console.width
    for listing in listings:
        table, at = listing.table(width, console)
        console.width = at  # wider than the screen only for a pipe or essential columns
        try:
            console.print(table, crop=False)
        finally:
            console.width = screen
