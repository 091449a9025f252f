"""Reading a terminal's bytes back: each visible character with the colours it was drawn in."""

from __future__ import annotations

import re
from dataclasses import dataclass

SGR = re.compile(r"\x1b\[([0-9;]*)m")
OTHER_ESCAPE = re.compile(r"\x1b(?:\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9])")
NAMES = {
    30: "black",
    31: "red",
    32: "green",
    33: "yellow",
    34: "blue",
    35: "magenta",
    36: "cyan",
    37: "white",
}


@dataclass(frozen=True)
class Cell:
    char: str
    fg: str | None
    bg: str | None
    bold: bool


def _apply(codes: list[int], state: dict) -> None:
    i = 0
    while i < len(codes):
        c = codes[i]
        if c == 0:
            state.update(fg=None, bg=None, bold=False)
        elif c == 1:
            state["bold"] = True
        elif c == 22:
            state["bold"] = False
        elif 30 <= c <= 37:
            state["fg"] = NAMES[c]
        elif 90 <= c <= 97:
            state["fg"] = "bright_" + NAMES[c - 60]
        elif c == 39:
            state["fg"] = None
        elif 40 <= c <= 47:
            state["bg"] = NAMES[c - 10]
        elif c == 49:
            state["bg"] = None
        elif c in (38, 48) and i + 1 < len(codes):
            key = "fg" if c == 38 else "bg"
            if codes[i + 1] == 5:
                state[key] = f"color({codes[i + 2]})"
                i += 2
            elif codes[i + 1] == 2:
                state[key] = "rgb({},{},{})".format(*codes[i + 2 : i + 5])
                i += 4
        i += 1


def cells(text: str) -> list[Cell]:
    """Every character of ``text`` (escape sequences removed) with its SGR state."""
    state: dict = {"fg": None, "bg": None, "bold": False}
    out: list[Cell] = []
    pos = 0
    for m in SGR.finditer(text):
        for ch in OTHER_ESCAPE.sub("", text[pos : m.start()]):
            out.append(Cell(ch, state["fg"], state["bg"], state["bold"]))
        _apply([int(x) for x in m.group(1).split(";") if x] or [0], state)
        pos = m.end()
    for ch in OTHER_ESCAPE.sub("", text[pos:]):
        out.append(Cell(ch, state["fg"], state["bg"], state["bold"]))
    return out
