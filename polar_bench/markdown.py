"""polar_bench/chat.py's figures as the README's Markdown table, goals judged from the numbers.

    python -m polar_bench chat --quick --json F --markdown   # run, then print the table
    python -m polar_bench markdown F                    # the table of a saved run

So that the documentation's table is what the script printed, not a transcription of it
(render.py puts it into docs/performance.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

HEADER = (
    "figure",
    "polar-mitm",
    "mitm-stream",
    "capture-floor",
    "mitm-buffered",
    "direct",
    "LiteLLM",
    "ratio",
    "goal",
    "vs capture-floor (its ratio)",
)
RSS_FLAT = 1.10  # last over first RSS point: more is growth per call, not start-up
SHOWN = ("mitm-stream", "capture-floor", "mitm-buffered", "direct", "litellm")


def _goal(value: float, limit: float, at_most: bool) -> str:
    met = value <= limit if at_most else value >= limit
    sign = "<=" if at_most else ">="
    return f"{sign} {limit:.2f} " + ("met" if met else "**missed**")


def _cell(value: float | None, unit: str = "") -> str:
    return "" if value is None or value != value else f"{value:.1f}{unit}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown(results: dict) -> str:
    cols = results["columns"]
    direct = cols["direct"]
    lines = [_row(list(HEADER)), _row(["---"] * len(HEADER))]

    def figure(
        label: str,
        value: Callable[[dict], float],
        unit: str,
        limit: float,
        at_most: bool = True,
        of_direct: bool = True,  # False for what is added to direct (latency) or none (CPU)
    ) -> None:
        def of(column: str) -> float | None:
            if column == "direct" and not of_direct:
                return None
            try:
                return value(cols[column])
            except (KeyError, TypeError):
                return None

        polar, stream, floor = of("polar-mitm"), of("mitm-stream"), of("capture-floor")
        assert polar is not None and stream is not None and floor is not None
        ratio = polar / stream
        cells = [label, _cell(polar, unit), *(_cell(of(c)) for c in SHOWN)]
        cells += [f"{ratio:.2f}", _goal(ratio, limit, at_most)]
        cells.append(f"{polar / floor:.2f} ({floor / stream:.2f})")
        lines.append(_row(cells))

    blank = [""] * len(SHOWN)

    def alone(label: str, value: str, ratio: str, goal: str = "") -> None:
        """A row with polar-mitm's figure and ratio only (no floor or other columns)."""
        lines.append(_row([label, value, *blank, ratio, goal, ""]))

    def added(conc: str, q: str) -> Callable[[dict], float]:
        return lambda c: c[conc][f"ttlb_ms_{q}"] - direct[conc][f"ttlb_ms_{q}"]

    for conc, n in (("c1", "1"), ("c32", "32")):
        figure(f"TTFB p50, {n} concurrent", lambda c, k=conc: c[k]["ttfb_ms_p50"], " ms", 1.15)
        for q in ("p50", "p99"):
            figure(f"added latency {q}, {n} conc.", added(conc, q), " ms", 1.10, of_direct=False)
    figure("calls/s, 32 concurrent", lambda c: c["throughput"]["calls_per_s"], "", 0.85, False)

    def cpu_per_1k(column: dict) -> float:
        return column["throughput"]["cpu_s_per_1k_calls"]

    figure("proxy CPU-s per 1,000 calls", cpu_per_1k, "", 1.5, of_direct=False)
    stream = cols["mitm-stream"]
    for column in (c for c in cols if c.startswith("polar-mitm+")):
        x, name = cols[column], column.removeprefix("polar-mitm+")
        for conc, n in (("c1", "1"), ("c32", "32")):
            v = added(conc, "p50")(x)
            ratio = f"{v / added(conc, 'p50')(stream):.2f}"
            alone(f"`{name}`: added latency p50, {n} conc.", f"{v:.1f} ms", ratio)
        t = x["throughput"]
        calls = t["calls_per_s"] / stream["throughput"]["calls_per_s"]
        cpu = cpu_per_1k(x) / cpu_per_1k(stream)
        value = f"{t['calls_per_s']:.1f}; {cpu_per_1k(x):.1f}"
        alone(f"`{name}`: calls/s; CPU-s per 1,000 calls", value, f"{calls:.2f}; {cpu:.2f}")
    rss = cols["polar-mitm"].get("rss")
    if rss:
        first, last, peak = rss[1][1], rss[-1][1], max(mb for _, mb in rss[1:])
        flat = last / first <= RSS_FLAT
        alone(
            f"proxy RSS, {rss[1][0]:,} -> {rss[-1][0]:,} calls",
            f"{first:.0f} -> {last:.0f} MB (peak {peak:.0f})",
            f"{last / first:.2f}",
            f"flat (<= {RSS_FLAT:.2f}): " + ("met" if flat else "**missed**"),
        )
    inproc = results.get("inprocess", {})
    merge, parquet = inproc.get("merge_time_2N_over_N"), inproc.get("parquet_flush_vs_raw")
    if isinstance(merge, float):
        alone("merge time 2N / N turns", "", f"{merge:.2f}", _goal(merge, 2.3, True))
    if isinstance(parquet, float):
        alone(
            "Parquet flush vs raw `write_table`", "", f"{parquet:.2f}x", _goal(parquet, 0.5, False)
        )
    on, off = inproc.get("fidelity_us_per_call_check"), inproc.get("fidelity_us_per_call_off")
    if isinstance(on, float) and isinstance(off, float):
        value = f"{on:.0f} us vs {off:.0f} us"
        alone("fidelity check vs off, per call", value, f"{on / off:.2f}", "(off the hot path)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(__doc__)
    print(markdown(json.loads(Path(argv[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
