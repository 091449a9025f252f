#!/usr/bin/env python
"""Per-call cost of the fidelity checks: `polar_fidelity=check` against `off`, as a ratio.

    python -m polar_bench fidelity [--turns 40] [--repeat 5] [--drift-every 4]

A tool-loop rollout is built with the real Qwen3 tokenizer and chat template (each prompt the
template's rendering of the conversation so far, each output the turn as the template writes
it, reasoning included; the prompt grows from about 300 to several thousand tokens). Every call
goes through `CallPipeline.call_finished` as the capture path hands it over, with the store
replaced by building the calls/ row (`record.to_row()`), and is timed in CPU time of this thread:

- off: merge into the rollout + the row (what the proxy did per call before the checks);
- check: the same + the checks (decode/encode of the output, special-token scan of the request,
  counts) — on a clean rollout, where no break needs explaining;
- check, drifting: every `--drift-every`-th call the harness sent an earlier turn back without
  its reasoning, so that call's break is explained turn by turn.

In the proxy the checks run in a worker thread after the harness has its reply: this is CPU they
take, not latency the harness sees. Rendering the prompts (the inputs) is outside the clock.

    python -m polar_bench fidelity --proxy [--calls 60]

measures the whole proxy instead: the reference policy server, and mitmdump with the addon run
twice (`polar_fidelity=off`, then `check` with the Qwen3 tokenizer); the same sequential calls
through each (HTTPS via the proxy, streamed; rollouts of two calls whose second sends the first
reply back without its reasoning and a new user turn, so every second call is a re-render to
explain); proxy CPU-seconds per call from /proc, and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from array import array
from pathlib import Path

from polar_mitm.addons.pipeline import CallPipeline
from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.core.record import CallRecord
from polar_mitm.tokens.conversation import render_input
from polar_mitm.tokens.fidelity import CHECK, OFF, FidelityStage
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.trajectory.rollouts import Rollouts

from . import core

CLOCK = time.thread_time
TOOLS = core.SHELL_TOOLS
OUTPUT = "\n".join(f"line {i}: some tool output with words and numbers {i * 7}" for i in range(12))


class RowSink:
    """Stands in for the store: builds the row, as StoreAddon does (no I/O)."""

    def call_finished(self, record: CallRecord) -> None:
        record.to_row()


def build(turns: int, drift_every: int) -> list[dict]:
    """The calls of one rollout: prompt ids, output ids, the request body."""
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    hf = tok.impl

    def render(messages: list[dict], generation: bool) -> str:
        inp = render_input({"messages": messages, "tools": TOOLS})
        return hf.apply_chat_template(
            inp.messages, tools=inp.tools, add_generation_prompt=generation, tokenize=False
        )

    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell. " * 20},
        {"role": "user", "content": "Find the failing test and fix it."},
    ]
    calls = []
    for t in range(turns):
        reasoning = f"Step {t}: look at the next file and check what the test expects from it."
        args = {"cmd": f"cat src/module_{t}.py"}
        reply = {
            "role": "assistant",
            "content": "",
            "reasoning_content": reasoning,
            "tool_calls": [
                {"type": "function", "function": {"name": "run_shell", "arguments": args}}
            ],
        }
        sent = messages
        if drift_every and t and t % drift_every == 0:  # the harness dropped the last reasoning
            sent = copy.deepcopy(messages)
            for m in reversed(sent):
                if m["role"] == "assistant":
                    m.pop("reasoning", None)
                    break
        prompt = render(sent, True)
        full = render([*sent, reply], False)
        text = full[len(prompt) :]
        text = text[: text.index("<|im_end|>") + len("<|im_end|>")]
        calls.append(
            {
                "prompt": array("i", tok.encode(prompt)),
                "output": tok.encode(text),
                "request_json": json.dumps({"messages": sent, "tools": TOOLS}),
            }
        )
        messages = [
            *sent,
            {
                "role": "assistant",
                "content": "",
                "reasoning": reasoning,
                "tool_calls": [
                    {
                        "id": f"call_{t}",
                        "type": "function",
                        "function": {"name": "run_shell", "arguments": json.dumps(args)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"call_{t}", "content": OUTPUT},
        ]
    return calls


def run(calls: list[dict], mode: str) -> tuple[float, dict[str, int]]:
    """CPU seconds of the stage over the rollout, and the flags it raised."""
    tok = load_tokenizer(str(qwen3_tokenizer_dir())) if mode != OFF else None
    stage = CallPipeline(
        control=None,
        rollouts=Rollouts(lambda rows: None),
        checks=FidelityStage(),
        final=[RowSink()],
    )
    stage.configure_checks(mode, tok)
    flags: dict[str, int] = {}
    spent = 0.0
    for c in calls:
        record = CallRecord(
            rollout_id="bench.0",
            prompt_token_ids=c["prompt"],
            output_token_ids=list(c["output"]),
            output_logprobs=[-0.5] * len(c["output"]),
            ids_source="upstream",
            status="completed",
            trainable=True,
            usage_prompt_tokens=len(c["prompt"]),
            usage_completion_tokens=len(c["output"]),
            request_json=c["request_json"],
        )
        t0 = CLOCK()
        stage.call_finished(record)  # no event loop: the checks run inline, on this clock
        spent += CLOCK() - t0
        for f in record.fidelity_flags:
            flags[f] = flags.get(f, 0) + 1
    return spent, flags


def best(calls: list[dict], mode: str, repeat: int) -> tuple[float, dict[str, int]]:
    gc.disable()
    try:
        runs = [run(calls, mode) for _ in range(repeat)]
    finally:
        gc.enable()
    return min(runs, key=lambda r: r[0])


def figures(smoke: bool = False, turns: int = 40, repeat: int = 5, drift_every: int = 4) -> dict:
    """The figures `polar_bench/chat.py` shows among its in-process ones."""
    if smoke:
        turns, repeat = 6, 1
    clean = build(turns, 0)
    drifting = build(turns, drift_every)
    off, _ = best(clean, OFF, repeat)
    check, clean_flags = best(clean, CHECK, repeat)
    off_d, _ = best(drifting, OFF, repeat)
    check_d, drift_flags = best(drifting, CHECK, repeat)
    assert not clean_flags, f"a clean rollout was flagged: {clean_flags}"
    assert drift_flags.get("reasoning_dropped"), "the drifting rollout was not flagged"
    n = len(clean)
    return {
        "fidelity_us_per_call_off": off / n * 1e6,
        "fidelity_us_per_call_check": check / n * 1e6,
        "fidelity_check_vs_off": check / off,
        "fidelity_us_per_call_check_drifting": check_d / n * 1e6,
        "fidelity_check_vs_off_drifting": check_d / off_d,
        "fidelity_prompt_tokens_last": float(len(clean[-1]["prompt"])),
    }


PROXY_SCENARIO = {
    "model": "Qwen/Qwen3-4B",
    "scripts": [
        {
            "name": "chat",
            "turns": [
                {
                    "reasoning": "Think about the question for a while. " * 8,
                    "content": "Here is a longer answer with some detail. " * 10,
                },
                {"reasoning": "A follow-up.", "content": "Still here. " * 10},
            ],
        }
    ],
}


def proxy_figures(calls: int = 60) -> dict:
    """Proxy CPU per call with polar_fidelity=off vs check (real mitmdump + reference server)."""
    tokenizer = str(qwen3_tokenizer_dir())
    modes = {
        mode: {"polar_fidelity": mode, "polar_tokenizer": tokenizer} for mode in ("off", "check")
    }
    got = core.proxy_cpu_by_mode(
        PROXY_SCENARIO,
        modes,
        lambda client, mode: _conversations(client, 4, f"warm-{mode}"),
        lambda client, mode: _conversations(client, calls // 2, mode),
    )
    out: dict = {
        f"proxy_ms_cpu_per_call_{mode}": cpu / (2 * (calls // 2)) * 1e3
        for mode, (cpu, _) in got.items()
    }
    out["proxy_cpu_check_vs_off"] = (
        out["proxy_ms_cpu_per_call_check"] / out["proxy_ms_cpu_per_call_off"]
    )
    return out


def _conversations(client, n: int, tag: str) -> None:
    url = "https://api.openai.com/v1/chat/completions"
    for i in range(n):
        headers = {"authorization": f"Bearer polar-{tag}-{i}"}
        messages = [{"role": "user", "content": "Tell me about the weather. " * 30}]
        for turn in range(2):
            body = {"model": "gpt-4.1", "messages": messages, "stream": True}
            text = []
            with client.stream("POST", url, json=body, headers=headers) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                        text.append(delta.get("content") or "")
            if turn == 0:  # sent back without its reasoning, then a new user turn
                messages += [
                    {"role": "assistant", "content": "".join(text)},
                    {"role": "user", "content": "And tomorrow?"},
                ]


# The figures' names in a saved run's table (those not named here show their key).
LABELS = {
    "fidelity_us_per_call_off": "off (merge + the calls/ row), us per call",
    "fidelity_us_per_call_check": "check, clean rollout, us per call",
    "fidelity_check_vs_off": "check / off, clean rollout",
    "fidelity_us_per_call_check_drifting": "check, every 4th call re-renders an earlier turn without "
    "its reasoning, us per call",
    "fidelity_check_vs_off_drifting": "check / off, drifting rollout",
    "fidelity_prompt_tokens_last": "the last prompt's tokens",
    "proxy_ms_cpu_per_call_off": "proxy CPU per call, polar_fidelity=off, ms",
    "proxy_ms_cpu_per_call_check": "proxy CPU per call, check (Qwen3 tokenizer), ms",
    "proxy_cpu_check_vs_off": "proxy CPU per call, check / off",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    ap.add_argument("--drift-every", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny counts: only checks that it runs")
    ap.add_argument("--proxy", action="store_true", help="measure the whole proxy (mitmdump)")
    ap.add_argument("--calls", type=int, default=60, help="calls per proxy with --proxy")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.proxy:
        out = proxy_figures(args.calls)
    else:
        out = figures(args.smoke, args.turns, args.repeat, args.drift_every)
    argv = sys.argv[1:] if argv is None else argv
    core.report_figures(out, LABELS, "fidelity", args.json, argv)


if __name__ == "__main__":
    main()
