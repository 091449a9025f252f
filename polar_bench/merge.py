#!/usr/bin/env python
"""Prefix-merge cost: N vs 2N turns of one rollout whose prompt starts at 2k tokens and grows.

    python -m polar_bench merge [--turns 200] [--base 2000] [--env 150] [--out 100]
                                            [--side-every 0] [--lists] [--repeat 3]

Each turn's prompt is the whole chain so far plus `--env` new tokens (a tool result); its output
is `--out` sampled tokens. A prompt is an `array('i')` (what the capture path hands the merge)
or, with `--lists`, a Python list (converted by the merge). It is built right before its call,
outside the clock, so it is as warm in the cache as a prompt the proxy has just decoded; with
`--cold` all prompts are built up front instead (the one memcmp per call then reads cold memory).
Figures: the time to merge N and 2N turns and their ratio (goal <= 2.3: linear in the new
tokens; the prompts themselves grow, so anything that walks every prompt in Python is
quadratic; times are CPU time of the merging thread), the time per turn at the end, and the peak memory the merge allocates for the
rollout (tracemalloc, in a separate run) per token of the final chain. With `--side-every K`,
every K-th call is also a side call that shares most of the prompt (a break: the longest common
prefix is searched).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from array import array
from pathlib import Path

from polar_mitm.trajectory.merge import Merger

from . import core

# CPU time of this thread: the figures hold on a shared machine (time spent descheduled is not
# the merge's). The merge does no I/O, so its CPU time is its cost.
CLOCK = time.thread_time


class Call:
    """One call's inputs; the prompt is materialized by `prompt()` (a fresh copy)."""

    def __init__(self, full: array, end: int, output: array, purpose: str, lists: bool) -> None:
        self.full, self.end, self.output, self.purpose, self.lists = (
            full,
            end,
            output,
            purpose,
            lists,
        )
        self.logprobs = [-0.5] * len(output)
        self.suffix = array("i", [7, 7, 7]) if purpose != "main" else array("i")

    def prompt(self):
        p = self.full[: self.end] + self.suffix
        return p.tolist() if self.lists else p


def build(turns: int, base: int, env: int, out: int, side_every: int, lists: bool, seed: int = 0):
    rng = random.Random(seed)
    total = base + turns * (env + out)
    full = array("i", (rng.randrange(151_000) for _ in range(total)))
    calls = []
    pos = base
    for t in range(turns):
        end = pos + (env if t else 0)
        calls.append(Call(full, end, full[end : end + out], "main", lists))
        pos = end + out
        if side_every and t % side_every == side_every - 1:
            calls.append(Call(full, end - env // 2, array("i", [1, 2, 3]), "title", lists))
    return calls


def merge(calls: list[Call], cold: bool, prompts: list | None = None) -> tuple[float, Merger]:
    m = Merger()
    spent = 0.0
    if cold and prompts is None:
        prompts = [c.prompt() for c in calls]
    for i, c in enumerate(calls):
        prompt = prompts[i] if prompts is not None else c.prompt()
        t0 = CLOCK()
        m.add(prompt, c.output, c.logprobs, purpose=c.purpose)
        spent += CLOCK() - t0
    return spent, m


def alternate(
    every: dict[int, list[Call]], repeat: int, cold: bool = False
) -> dict[int, tuple[float, Merger]]:
    """The best (time, merger) of `repeat` merges of each rollout size, the sizes alternating:
    a machine that slows down or speeds up part-way (other processes, frequency, caches) then
    moves every size alike, not just one. (Timed one size after the other, the default 2N/N
    ratio moved between 1.95 and 2.82 in nine runs here; alternating, between 2.28 and 2.38.)"""
    runs: dict[int, list[tuple[float, Merger]]] = {n: [] for n in every}
    gc.disable()  # time the merge, not collections triggered by the harness's garbage
    for _ in range(repeat):
        for n, calls in every.items():
            runs[n].append(merge(calls, cold))
    gc.enable()
    return {n: min(r, key=lambda x: x[0]) for n, r in runs.items()}


def figures(smoke: bool = False) -> dict:
    """The merge figures for polar_bench/chat.py: time(2N)/time(N) and peak memory per rollout."""
    turns, repeat = (10, 2) if smoke else (100, 9)
    every = {n: build(n, 2000, 150, 100, 0, False) for n in (turns, 2 * turns)}
    best = alternate(every, repeat)
    prompts = [c.prompt() for c in every[2 * turns]]
    tracemalloc.start()
    merge(every[2 * turns], cold=True, prompts=prompts)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "merge_time_2N_over_N": best[2 * turns][0] / best[turns][0],
        f"merge_peak_MiB_per_rollout_{2 * turns}_turns": peak / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=100, help="N (the second run has 2N)")
    ap.add_argument("--base", type=int, default=2000, help="tokens of the first prompt")
    ap.add_argument("--env", type=int, default=150, help="new environment tokens per turn")
    ap.add_argument("--out", type=int, default=100, help="sampled tokens per turn")
    ap.add_argument("--side-every", type=int, default=0, help="add a side call every K turns")
    ap.add_argument("--lists", action="store_true", help="hand prompts as lists, not arrays")
    ap.add_argument("--cold", action="store_true", help="build every prompt before merging")
    ap.add_argument("--repeat", type=int, default=7, help="best of this many runs")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)

    sizes = (args.turns, 2 * args.turns)
    every = {n: build(n, args.base, args.env, args.out, args.side_every, args.lists) for n in sizes}
    bests = alternate(every, args.repeat, args.cold)
    results = {}
    table = []
    for turns in sizes:
        calls = every[turns]
        best, merger = bests.pop(turns)
        last = calls[max(i for i, c in enumerate(calls) if c.purpose == "main")]
        expected = last.full[: last.end] + last.output
        assert merger.chains[0].tokens == expected, "the main chain is not the last prompt + output"
        # the last main call's cost alone (the rest merged first)
        m = Merger()
        for c in calls[: calls.index(last)]:
            m.add(c.prompt(), c.output, c.logprobs, purpose=c.purpose)
        prompt = last.prompt()
        t0 = CLOCK()
        m.add(prompt, last.output, last.logprobs)
        last_us = (CLOCK() - t0) * 1e6
        del m, prompt
        # peak memory the merge allocates for the whole rollout: its chains and indexes (the
        # prompts are the caller's: built before tracing starts)
        prompts = [c.prompt() for c in calls]
        tracemalloc.start()
        _, merged = merge(calls, cold=True, prompts=prompts)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del prompts
        chain_tokens = sum(len(c) for c in merged.chains)
        results[turns] = best
        table.append(
            (
                f"{turns} turns ({len(calls)} calls), final prompt {last.end:,} tokens",
                f"{best * 1e3:.2f} ms ({best / len(calls) * 1e6:.1f} us/call)",
                f"{last_us:.1f} us",
                f"{peak / 2**20:.2f} MiB, {peak / chain_tokens:.1f} B/token, "
                f"{len(merged.chains)} chain(s)",
            )
        )
        print(
            f"turns={turns:5d}  calls={len(calls):5d}  final prompt={last.end:7d} tok  "
            f"merge={best * 1e3:8.2f} ms ({best / len(calls) * 1e6:6.1f} us/call)  "
            f"last call={last_us:7.1f} us  chains={len(merged.chains)}  "
            f"peak={peak / 2**20:6.2f} MiB ({peak / chain_tokens:5.2f} B/token)"
        )
    ratio = results[2 * args.turns] / results[args.turns]
    kind = ("lists" if args.lists else "arrays") + (", built up front" if args.cold else "")
    print(f"time(2N)/time(N) = {ratio:.2f}  (goal <= 2.3; prompts as {kind})")
    if args.json:
        table.append(
            (f"time(2N) / time(N) (goal <= 2.3; prompts as {kind})", f"{ratio:.2f}", "", "")
        )
        header = ("rollout", "merge, best of --repeat", "the last main call", "peak memory")
        results_out = {"config": vars(args) | {"json": str(args.json)}, "time_2N_over_N": ratio}
        core.report(
            results_out,
            header,
            lambda _: table,
            "merge",
            args.json,
            sys.argv[1:] if argv is None else argv,
        )


if __name__ == "__main__":
    main()
