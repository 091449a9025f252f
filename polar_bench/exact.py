#!/usr/bin/env python
"""Per-call cost of exact-prefix mode (`polar_exact_prefix`) against chat mode.

    python -m polar_bench exact [--turns 40] [--repeat 3]

In-process: a tool-loop rollout built with the real Qwen3 tokenizer and chat template (prompts
growing from about 300 to several thousand tokens; the harness drops each turn's reasoning). Every
call goes through what exact-prefix mode adds to the proxy, timed in CPU time of this thread:

- hot path (before the call goes upstream, in a worker thread): `ExactPrefix.plan` — message keys
  of the request, the chain match, the new messages rendered with the template and tokenized —
  and `remember` (on the event loop, when the call completes);
- with `polar_exact_compare` only (off by default), off the hot path: `compare`, what chat mode
  would have sent (the whole conversation rendered and tokenized).

Chat mode adds none of these, so the figures are absolute milliseconds per call, for the first and
the last quarter of the rollout (the hot path must not grow with the conversation).

    python -m polar_bench exact --long [--turns 30]

the hot path on python -m polar_bench long's sessions instead (a 40k-character system prompt, 10
long tools, a 6k-character tool result a turn, prompts to ~80k tokens): `plan` per call, and at
the last turn each of its parts (CPU, median of 30 runs).

    python -m polar_bench exact --proxy [--conversations 6]

measures the whole proxy instead: the reference policy server, and mitmdump with the addon run
twice (chat mode, then `polar_exact_prefix=true`, both with the Qwen3 tokenizer and the fidelity
checks on); the same sequential 8-call tool loops through each (HTTPS via the proxy, streamed);
proxy CPU-seconds per call from /proc, the median time to the last byte per call, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.core.record import CallRecord
from polar_mitm.output_parsers import family
from polar_mitm.tokens.conversation import render_input
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.trajectory.exact_prefix import ExactPrefix

from . import core

CLOCK = time.thread_time
TOOLS = core.SHELL_TOOLS
IM_END = "<|im_end|>"


def build(book: ExactPrefix, turns: int) -> list[dict]:
    """The calls of one rollout: request body, prompt ids, the reply and its sampled ids."""
    tok = book.tokenizer
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use run_shell."},
        {"role": "user", "content": "Find the failing test and fix it."},
    ]
    calls = []
    for t in range(turns):
        prompt = book.chat_prompt_ids({"messages": messages, "tools": TOOLS})
        reply = {
            "role": "assistant",
            "content": None,
            "reasoning": f"\nStep {t}: look further.\n",
            "tool_calls": [
                {
                    "id": f"call_{t}",
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": json.dumps({"cmd": f"ls {t}"})},
                }
            ],
        }
        normalized = render_input({"messages": [*messages, reply], "tools": TOOLS}).messages
        full = tok.impl.apply_chat_template(
            normalized, tools=TOOLS, tokenize=False, add_generation_prompt=False
        )
        text = full[: full.rindex(IM_END) + len(IM_END)]
        output = tok.encode(text)[len(prompt) :]
        calls.append(
            {
                "chat": {"messages": list(messages), "tools": TOOLS},
                "prompt": prompt,
                "reply": reply,
                "output": output,
            }
        )
        sent_back = {k: v for k, v in reply.items() if k != "reasoning"}  # the harness drops it
        messages += [
            sent_back,
            {"role": "tool", "tool_call_id": f"call_{t}", "content": f"file_{t}.py\n" * 40},
        ]
    return calls


def run(book: ExactPrefix, calls: list[dict]) -> tuple[list[float], list[float], int]:
    """CPU ms per call on the hot path and in `compare`; token-in calls."""
    book.forget("bench")
    hot, off, token_in = [], [], 0
    for i, call in enumerate(calls):
        t0 = CLOCK()
        lookup = book.plan(book.chains("bench"), call["chat"], 262144)
        prompt = lookup.plan.prompt_ids if lookup.plan is not None else call["prompt"]
        book.remember("bench", lookup, call["reply"], prompt, call["output"], f"c{i}")
        hot.append((CLOCK() - t0) * 1e3)
        if lookup.plan is not None:
            token_in += 1
            record = CallRecord(rollout_id="bench", prompt_token_ids=prompt)
            t0 = CLOCK()
            book.compare(record, call["chat"], lookup.note())
            off.append((CLOCK() - t0) * 1e3)
    return hot, off, token_in


def figures(smoke: bool = False, turns: int = 40, repeat: int = 3) -> dict:
    book = ExactPrefix(load_tokenizer(str(qwen3_tokenizer_dir())), family("qwen3"))
    calls = build(book, 6 if smoke else turns)
    best: tuple[list[float], list[float], int] | None = None
    for _ in range(1 if smoke else repeat):
        result = run(book, calls)
        if best is None or sum(result[0]) < sum(best[0]):
            best = result
    assert best is not None
    hot, off, token_in = best
    q = max(1, len(hot) // 4)
    return {
        "exact_calls": len(calls),
        "exact_token_in_calls": token_in,
        "exact_prompt_tokens_last": len(calls[-1]["prompt"]),
        "exact_hot_ms_cpu_per_call": statistics.fmean(hot),
        "exact_hot_ms_cpu_first_quarter": statistics.fmean(hot[:q]),
        "exact_hot_ms_cpu_last_quarter": statistics.fmean(hot[-q:]),
        "exact_compare_ms_cpu_per_call": statistics.fmean(off) if off else 0.0,
    }


PROXY_SCENARIO = {
    "model": "Qwen/Qwen3-4B",
    "scripts": [
        {
            "name": "loop",
            "match": {"tools_include": "run_shell"},
            "turns": [
                *(
                    {
                        "reasoning": f"Step {i}: look further.",
                        "tool_calls": [{"name": "run_shell", "arguments": {"cmd": f"ls {i}"}}],
                    }
                    for i in range(7)
                ),
                {"reasoning": "Done.", "content": "The failing test is fixed."},
            ],
        }
    ],
}


def proxy_figures(conversations: int = 6) -> dict:
    """Proxy CPU and time per call, chat mode vs exact-prefix mode (real mitmdump)."""
    tokenizer = str(qwen3_tokenizer_dir())
    modes = {
        mode: {"polar_tokenizer": tokenizer, "polar_exact_prefix": str(mode == "exact").lower()}
        for mode in ("chat", "exact")
    }
    got = core.proxy_cpu_by_mode(
        PROXY_SCENARIO,
        modes,
        lambda client, mode: _tool_loops(client, 1, f"warm-{mode}"),
        lambda client, mode: _tool_loops(client, conversations, mode),
    )
    out: dict = {}
    for mode, (cpu, times) in got.items():
        out[f"proxy_ms_cpu_per_call_{mode}"] = cpu / len(times) * 1e3
        out[f"proxy_ms_ttlb_p50_{mode}"] = statistics.median(times) * 1e3
    out["proxy_cpu_exact_vs_chat"] = (
        out["proxy_ms_cpu_per_call_exact"] / out["proxy_ms_cpu_per_call_chat"]
    )
    out["proxy_ttlb_exact_vs_chat"] = out["proxy_ms_ttlb_p50_exact"] / out["proxy_ms_ttlb_p50_chat"]
    return out


def _tool_loops(client, n: int, tag: str) -> list[float]:
    """`n` tool loops of 8 calls; the harness drops reasoning. Seconds to the last byte."""
    url = "https://api.openai.com/v1/chat/completions"
    times = []
    for i in range(n):
        headers = {"authorization": f"Bearer polar-{tag}-{i}"}
        messages: list[dict] = [
            {"role": "system", "content": "You are a coding agent. Use run_shell."},
            {"role": "user", "content": "Find the failing test and fix it."},
        ]
        for _ in range(8):
            body = {"model": "gpt-4.1", "messages": messages, "tools": TOOLS, "stream": True}
            calls: dict[int, dict] = {}
            t0 = time.perf_counter()
            with client.stream("POST", url, json=body, headers=headers) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:]).get("choices") or ():
                        for t in (choice.get("delta") or {}).get("tool_calls") or ():
                            entry = calls.setdefault(t["index"], {"id": None, "args": ""})
                            entry["id"] = t.get("id") or entry["id"]
                            entry["args"] += (t.get("function") or {}).get("arguments") or ""
            times.append(time.perf_counter() - t0)
            if not calls:
                break
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": "run_shell", "arguments": c["args"]},
                }
                for c in calls.values()
            ]
            messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
            for c in tool_calls:
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": "x.py\n" * 40})
    return times


def long_figures(turns: int = 30) -> dict:
    """`plan` on bench_long's sessions: per call over the session, and its parts at the end."""
    import array

    from polar_mitm.trajectory import exact_prefix as ep
    from polar_mitm.trajectory.ids_json import ids_text, joined

    from . import long as bench_long

    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    tok.warm()
    book = ExactPrefix(tok, family("qwen3"))
    session = bench_long.Session(0)
    per_call = []
    for t in range(turns):
        body = session.body()
        t0 = CLOCK()
        lookup = book.plan(book.chains("long"), body, 262144)
        per_call.append((CLOCK() - t0) * 1e3)
        if lookup.plan is not None:
            prompt = lookup.plan.prompt_ids
        else:
            assert t == 0, lookup.reason
            prompt = ep.chat_prompt_ids(tok, "vllm", body)
        reasoning, content, arguments = bench_long.reply(t)
        name = f"tool_{t % bench_long.TOOLS}"
        reply = {
            "role": "assistant",
            "content": content,
            "reasoning": reasoning,
            "tool_calls": [
                {
                    "id": f"call_{t}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ],
        }
        call = json.dumps({"name": name, "arguments": arguments})
        output = tok.encode(
            f"<think>\n{reasoning}\n</think>\n\n{content}\n<tool_call>\n{call}\n</tool_call>{IM_END}"
        )
        book.remember("long", lookup, reply, prompt, output, f"c{t}")
        session.advance(t)
    body = session.body()
    chain = book.chains("long")[-1]
    inp = render_input(body)
    tail = inp.messages[len(chain.keys) :]
    lead = [inp.messages[0]]
    stand_in = [
        *lead,
        {"role": "user", "content": "."},
        {**chain.last_assistant, "content": ep.SENTINEL},
        *tail,
    ]
    text = tok.render(stand_in, inp.tools, inp.kwargs)
    at = text.find(chain.eos_text, text.find(ep.SENTINEL))
    new_text = text[at + len(chain.eos_text) :]
    new = tok.encode(new_text)
    backend = tok.impl.backend_tokenizer

    def cpu(fn) -> float:
        fn()
        runs = []
        for _ in range(30):
            t0 = CLOCK()
            fn()
            runs.append((CLOCK() - t0) * 1e3)
        return statistics.median(runs)

    q = max(1, turns // 5)
    return {
        "long_plan_ms_cpu_per_call": statistics.fmean(per_call[1:]),
        "long_plan_ms_cpu_last_fifth": statistics.fmean(per_call[-q:]),
        "long_last_chain_tokens": len(chain.tokens),
        "long_last_new_tokens": len(new),
        "long_last_plan_ms": cpu(lambda: book.plan([chain], body, 262144)),
        "long_last_render_input_ms": cpu(lambda: render_input(body)),
        "long_last_message_keys_ms": cpu(lambda: [ep.message_key(m) for m in inp.messages]),
        "long_last_context_key_ms": cpu(lambda: ep._context_key(inp)),
        "long_last_render_ms": cpu(lambda: tok.render(stand_in, inp.tools, inp.kwargs)),
        "long_last_encode_ms": cpu(lambda: tok.encode(new_text)),
        "long_last_encode_hf_ms": cpu(
            lambda: backend.encode(new_text, add_special_tokens=False).ids
        ),
        "long_last_prompt_ms": cpu(
            lambda: (
                chain.tokens + array.array("i", new),
                joined(book.texts.of(chain.last_call_id, chain.tokens), ids_text(new)),
            )
        ),
    }


# The figures' names in a saved run's table (those not named here show their key).
LABELS = {
    "exact_calls": "calls of the tool loop",
    "exact_token_in_calls": "of which token-in",
    "exact_prompt_tokens_last": "the last prompt's tokens",
    "exact_hot_ms_cpu_per_call": "hot path (plan + remember), ms CPU per call, whole rollout",
    "exact_hot_ms_cpu_first_quarter": "hot path, ms CPU per call, first quarter of the rollout",
    "exact_hot_ms_cpu_last_quarter": "hot path, ms CPU per call, last quarter of the rollout",
    "exact_compare_ms_cpu_per_call": "polar_exact_compare (off the hot path), ms CPU per call",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=None, help="40; --long: 30")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--smoke", action="store_true", help="tiny counts: only checks that it runs")
    ap.add_argument("--proxy", action="store_true", help="measure the whole proxy (mitmdump)")
    ap.add_argument("--long", action="store_true", help="the hot path on the long load's sessions")
    ap.add_argument("--conversations", type=int, default=6, help="tool loops per proxy (--proxy)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.proxy:
        out = proxy_figures(args.conversations)
    elif args.long:
        out = long_figures(args.turns or 30)
    else:
        out = figures(args.smoke, args.turns or 40, args.repeat)
    argv = sys.argv[1:] if argv is None else argv
    core.report_figures(out, LABELS, "exact", args.json, argv)


if __name__ == "__main__":
    main()
