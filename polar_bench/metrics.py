"""The per-call cost of the Prometheus metrics update (metrics.py), with timeit:
`python -m polar_bench metrics`. The record is a finished call with the headers the
openai SDK sends, 2000 prompt and 200 sampled ids. For scale it also times `CallRecord.to_row()`,
which the store runs on every call; the two are timed in turns (best of 5 each)."""

from __future__ import annotations

import json
import timeit
from types import SimpleNamespace

from polar_mitm.control import ControlState
from polar_mitm.core.record import CallRecord
from polar_mitm.metrics import ProxyMetrics


def main(argv: list[str] | None = None) -> None:
    """Time both, in turns; print microseconds per call (no arguments)."""
    m = ProxyMetrics(ControlState(), SimpleNamespace(open={}), SimpleNamespace(store=None))
    r = CallRecord(rollout_id="t.0", dialect="openai_chat", status="completed")
    r.headers_json = json.dumps(
        {
            "host": "api.openai.com",
            "user-agent": "OpenAI/Python 1.99.0",
            "accept": "application/json",
            "content-type": "application/json",
            "x-stainless-lang": "python",
            "x-stainless-os": "Linux",
            "x-stainless-arch": "x64",
            "x-stainless-runtime": "CPython",
            "x-stainless-package-version": "1.99.0",
            "authorization": "[redacted]",
            "content-length": "1234",
        }
    )
    r.prompt_token_ids, r.output_token_ids = list(range(2000)), list(range(200))
    r.first_byte_at = r.started_at + 25000
    r.fidelity_json = json.dumps(
        {"checked": {"mode": "check", "tokenizer": "/x/tokenizer_files"}, "policy_tokens": 200}
    )
    call = SimpleNamespace(
        record=r, upstream_sent_at=r.started_at, upstream_first_at=r.started_at + 20000
    )
    cases = [
        ("metrics: record + added_latency", lambda: (m.record(r), m.added_latency(call)), 20000),
        ("for scale: CallRecord.to_row()", r.to_row, 1000),
    ]
    best = {name: float("inf") for name, _, _ in cases}
    for _ in range(5):  # in turns, so load on the machine moves both alike
        for name, f, n in cases:
            best[name] = min(best[name], timeit.timeit(f, number=n) / n)
    for name, seconds in best.items():
        print(f"{name}: {seconds * 1e6:.1f} us per call (best of 5)")


if __name__ == "__main__":
    main()
