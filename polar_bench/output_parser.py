#!/usr/bin/env python
"""Exact-prefix mode's output parser on the event loop: CPU per reply, streamed a token a chunk.

    python -m polar_bench output-parser [--repeat 5]

A token-in reply reaches the harness through `TokenInReply.chunks`, which runs the model family's
streaming parser (`output_parsers/qwen3.py`) on every upstream chunk, on the proxy's event loop.
vLLM streams one token a chunk. Replies here are the real Qwen3 tokenization of an assistant turn
(the reference server's rendering): a short one like `python -m polar_bench long`'s (reasoning, a sentence,
one small tool call) and ones whose tool call writes a file of N characters (what an agent's
`write_file` / `apply_patch` call carries), so a cost that grows faster than the reply shows.
Prints the CPU per reply and per token (best of --repeat).
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from pathlib import Path

from polar_reference.render import Renderer, RenderInput
from polar_reference.scenario import ToolCallSpec, Turn

from polar_mitm.call.token_in import TokenInReply
from polar_mitm.output_parsers import family
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.trajectory.exact_prefix import ExactPlan
from polar_mitm.upstream import UPSTREAMS, TokenTally

from . import core

SOURCE = Path(__file__).resolve().parent.parent / "polar_mitm" / "call" / "exchange.py"


def turns() -> dict[str, Turn]:
    text = SOURCE.read_text()
    out = {
        "short (bench --long's)": Turn(
            reasoning="Step 7: read the next file.",
            content="Looking at module 7.",
            tool_calls=(ToolCallSpec("tool_7", {"cmd": "cat src/module_7.py"}),),
        )
    }
    for size in (1000, 4000, 16000):
        out[f"write_file, {size:,} chars"] = Turn(
            reasoning="Rewrite the module.",
            content="Writing it now.",
            tool_calls=(ToolCallSpec("write_file", {"path": "a.py", "content": text[:size]}),),
        )
    return out


def one_reply(tok, ids: list[int], pieces: list[str]) -> float:
    plan = ExactPlan(array("i", [1]), b"[1]", 0, "c", {}, True, True, None)
    reply = TokenInReply(
        UPSTREAMS["vllm"]("http://127.0.0.1:9"),
        plan,
        family=family("qwen3"),
        tokenizer=tok,
        tally=TokenTally(),
        model="m",
        wants_logprobs=False,
    )
    chunks = []
    for i, (token_id, piece) in enumerate(zip(ids, pieces, strict=True)):
        logprobs = {"tokens": [f"token_id:{token_id}"], "token_logprobs": [-0.5]}
        finish = "stop" if i == len(ids) - 1 else None
        choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}
        chunks.append({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
    start = time.process_time()
    for chunk in chunks:
        reply.chunks(chunk)
    return time.process_time() - start


HEADER = ("reply", "tokens", "ms CPU per reply (best of --repeat)", "us per token")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    renderer = Renderer()
    tok = load_tokenizer(str(renderer.tokenizer_dir))
    inp = RenderInput(messages=[{"role": "user", "content": "go"}], tools=None, kwargs={})
    rows = []
    for name, turn in turns().items():
        completion = renderer.completion(inp, turn)
        ids, pieces = list(completion.ids), list(completion.pieces)
        best = min(one_reply(tok, ids, pieces) for _ in range(args.repeat))
        rows.append((name, str(len(ids)), f"{best * 1e3:.2f}", f"{best * 1e6 / len(ids):.1f}"))
    results = {"config": {"repeat": args.repeat}}
    argv = sys.argv[1:] if argv is None else argv
    core.report(results, HEADER, lambda _: rows, "output-parser", args.json, argv)


if __name__ == "__main__":
    main()
