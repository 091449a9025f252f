"""What every test of the tier checks against the real vLLM.

* exact ids: each completed call's prompt and output ids (and logprobs) are what the engine
  itself answered the proxy (recorder.py saw the reply);
* re-scoring: a trace's ``input_ids`` sent back to the engine's token-in ``/v1/completions``
  (a list of ids as ``prompt``, ``prompt_logprobs``) and compared token by token where
  ``loss_mask`` is 1: within ``TOLERANCE`` nats on every token not sampled under a grammar, and
  every token further off than that inside a span the record flags as constrained.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from polar_reference.vllm_launch import SERVED_MODEL

from .recorder import Recorder

TOLERANCE = 0.01  # nats


def rescore(url: str, ids: list[int]) -> list[float | None]:
    """The engine's own logprob of each of ``ids`` given the ones before (None for the first)."""
    body = {
        "model": SERVED_MODEL,
        "prompt": ids,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids)
    out: list[float | None] = []
    for token, entry in zip(ids, entries, strict=True):
        out.append(None if entry is None else entry[str(token)]["logprob"])
    return out


@dataclass
class Rescored:
    policy_tokens: int
    constrained_tokens: int
    max_unconstrained_diff: float
    max_constrained_diff: float
    off_tokens: int  # policy tokens further than TOLERANCE from the re-scoring
    off_flagged: int  # ... of them inside a flagged constrained span


def constrained_positions(trace: dict) -> set[int]:
    spans = trace.get("constrained_spans") or []
    return {i for s, e in zip(spans[::2], spans[1::2], strict=True) for i in range(s, e)}


def check_rescoring(url: str, trace: dict) -> Rescored:
    """The trace's recorded logprobs against the engine's re-scoring (see the module doc)."""
    ids, mask, lps = trace["input_ids"], trace["loss_mask"], trace["logprobs"]
    engine = rescore(url, ids)
    flagged = constrained_positions(trace)
    assert all(mask[i] == 1 for i in flagged), "a constrained span covers environment tokens"
    free, bound, off, off_flagged = [], [], 0, 0
    for i, (m, lp, want) in enumerate(zip(mask, lps, engine, strict=True)):
        if m != 1:
            continue
        assert want is not None
        diff = abs(lp - want)
        (bound if i in flagged else free).append(diff)
        if diff > TOLERANCE:
            off += 1
            off_flagged += i in flagged
    result = Rescored(
        policy_tokens=sum(mask),
        constrained_tokens=len(bound),
        max_unconstrained_diff=max(free, default=0.0),
        max_constrained_diff=max(bound, default=0.0),
        off_tokens=off,
        off_flagged=off_flagged,
    )
    assert result.max_unconstrained_diff <= TOLERANCE, result
    assert off_flagged == off, result  # every grammar-bent logprob is flagged
    return result


def check_exact(rows: list[dict], recorder: Recorder) -> None:
    """Each completed call carries the ids and logprobs the engine answered the proxy with:
    the recorder's successful upstream exchanges, in order, one per completed call."""
    answered = [
        e
        for e in recorder.exchanges
        if e.method == "POST" and e.status == 200 and e.path.startswith(("/v1/", "/inference/v1/"))
    ]
    done = [r for r in rows if r["status"] == "completed" and r["route"] != "local"]
    assert len(done) == len(answered), ([r["route"] for r in rows], [e.path for e in answered])
    for row, exchange in zip(done, answered, strict=True):
        prompt, out, lps = exchange.sampled()
        assert row["prompt_token_ids"] == prompt
        assert row["output_token_ids"] == out
        assert row["output_logprobs"] == pytest.approx(lps, abs=1e-6)
        assert row["ids_source"] == "upstream" and row["count_check"] == "ok"
