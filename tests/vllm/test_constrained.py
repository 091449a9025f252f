"""Grammar-constrained sampling on the real vLLM (docs/constrained.md): every request form that
makes vLLM sample under a grammar is recorded as such (`constrained_by`, `constrained_from`,
the traces' `constrained_spans`), every token whose logprob the grammar bent lies in a flagged
span (the engine's re-scoring finds no other), and `polar_harness_constraints=drop` leaves
`parallel_tool_calls: false` out so that nothing is bent."""

from __future__ import annotations

import json

import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.store import read_table
from tests.e2e.loopback.test_capture_e2e import calls_of
from tests.e2e.loopback.test_dialects_e2e import QUESTION, SYSTEM
from tests.e2e.loopback.test_fidelity_e2e import cli
from tests.helpers.clients import RUN_SHELL, http_client

from ..e2e.harnesses import FINAL_TEXT
from ..e2e.test_harnesses import ROLLOUTS, run_through_proxy
from .checks import check_exact, check_rescoring

PARALLEL = "parallel_tool_calls=false"
CHAT_URL = "https://api.openai.com/v1/chat/completions"
STRICT_SHELL = {"type": "function", "function": {**RUN_SHELL["function"], "strict": True}}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"lines": {"type": "integer"}}},
    },
}
# request extras -> what the record must say (None: sampled without a grammar)
CASES = {
    "auto": ({}, None),
    "parallel_false": ({"parallel_tool_calls": False}, ["parallel_tool_calls=false"]),
    "required": ({"tool_choice": "required"}, ["tool_choice=required"]),
    "named": (
        {"tool_choice": {"type": "function", "function": {"name": "run_shell"}}},
        ["tool_choice=named"],
    ),
    "strict": ({"tools": [STRICT_SHELL]}, ["strict_tools"]),
    "response_format": (
        {"tools": None, "response_format": SCHEMA, "max_tokens": 24},
        ["response_format=json_schema"],
    ),
}


def ask(client, rollout: str, stream: bool, extra: dict) -> None:
    body = {
        "model": "gpt-4.1",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "tools": [RUN_SHELL],
        "stream": stream,
        **extra,
    }
    body = {k: v for k, v in body.items() if v is not None}
    headers = {"authorization": f"Bearer polar-{rollout}"}
    with client.stream("POST", CHAT_URL, json=body, headers=headers) as r:
        r.read()
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode", ["pass", "drop"])
def test_every_grammar_bent_token_is_flagged(vllm, recorder, make_mitm, mode):
    mitm = make_mitm(
        recorder.url,
        polar_harness_constraints=mode,
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_fidelity="strict",
    )
    with http_client(mitm) as client:
        for i, (name, (extra, _)) in enumerate(CASES.items()):
            ask(client, f"{name}.0", bool(i % 2), extra)
    rows = calls_of(mitm)
    check_exact(rows, recorder)
    traces = {t["rollout_id"]: t for t in read_table(str(mitm.output), "traces").to_pylist()}
    figures = {}
    for row in rows:
        name = row["rollout_id"].split(".")[0]
        want = CASES[name][1]
        if mode == "drop" and want == ["parallel_tool_calls=false"]:
            want = None  # left out upstream: no grammar
            assert any("not sent upstream" in n for n in row["translation_notes"])
        assert (row["constrained_by"] or None) == want, (name, row["constrained_by"])
        trace = traces[row["rollout_id"]]
        scored = check_rescoring(vllm.url, trace)  # unflagged tokens within 0.01 nats
        figures[name] = (len(row["output_token_ids"]), scored)
        if want is None:
            assert row["constrained_from"] is None and scored.constrained_tokens == 0
            assert "constrained_sampling" not in row["fidelity_flags"]
            assert trace["trainable"] is True, trace["untrainable_reason"]
        else:
            assert scored.off_tokens > 0, (name, scored)  # the grammar did bend logprobs
            assert "constrained_sampling" in row["fidelity_flags"]
            assert trace["trainable"] is False
            assert "constrained_sampling" in trace["untrainable_reason"]
    # the CLI says it: the summary's grammar tokens, the fidelity report's calls by reason
    grammar = sum(
        len(r["output_token_ids"]) - r["constrained_from"]
        for r in rows
        if r["constrained_from"] is not None
    )
    summary = json.loads(cli("summary", str(mitm.output), "--json").stdout)
    assert summary["totals"]["constrained_tokens"] == grammar > 0
    report = json.loads(cli("fidelity", str(mitm.output), "--json").stdout)["total"]
    assert report["constrained_tokens"] == grammar
    assert report["constrained_calls"] == sum(bool(r["constrained_by"]) for r in rows)
    assert report["constrained_by"].get(PARALLEL, 0) == (mode == "pass")
    # output tokens, flagged, bent (> 0.01 nats off the re-scoring), largest difference
    print(
        mode,
        {
            k: (n, v.constrained_tokens, v.off_tokens, round(v.max_constrained_diff, 2))
            for k, (n, v) in figures.items()
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "exact"),
    [("pass", False), ("drop", False), ("pass", True)],
    ids=["pass", "drop", "pass-exact"],
)
def test_codex_parallel_tool_calls(
    mode, exact, vllm, recorder, harness_bin, netns, tmp_path, confdir, make_mitm
):
    """Codex sends parallel_tool_calls: false. Passed on, its tool-call tokens are sampled under
    vLLM's one-call grammar: recorded, flagged, and with polar_fidelity=strict the trace is not
    trainable; dropped, the policy samples from its own distribution and the trace is exact.
    In exact-prefix mode only the chain's first call goes the chat way (token-in carries no
    tools): that one is still constrained when the flag is passed."""

    def mitm(url, **kw):
        return make_mitm(
            url,
            polar_harness_constraints=mode,
            polar_tokenizer=str(qwen3_tokenizer_dir()),
            polar_fidelity="strict",
            polar_exact_prefix=str(exact).lower(),
            **kw,
        )

    result, seen, _ = run_through_proxy(
        "codex",
        harness_bin,
        netns,
        tmp_path,
        confdir,
        lambda *_: recorder,
        mitm,
        timeout=300.0,
        end_by="shutdown",
    )
    assert result.returncode == 0 and FINAL_TEXT in result.stdout, result.stderr
    check_exact(seen.calls, recorder)
    rollout, _ = ROLLOUTS["codex"]
    [trace] = [t for t in seen.traces if t["rollout_id"] == rollout and t["role"] == "main"]
    scored = check_rescoring(recorder.url, trace)
    sent = [e.body for e in recorder.chats()]
    if exact:
        assert [r["route"] for r in seen.calls] == ["chat", "token_in"]
        assert [r["constrained_by"] or None for r in seen.calls] == [[PARALLEL], None]
        assert scored.off_tokens > 0 and trace["trainable"] is False
    elif mode == "pass":
        assert all(b.get("parallel_tool_calls") is False for b in sent)
        assert all(r["constrained_by"] == ["parallel_tool_calls=false"] for r in seen.calls)
        assert scored.off_tokens > 0 and trace["trainable"] is False
    else:
        assert not any("parallel_tool_calls" in b for b in sent)
        assert scored.constrained_tokens == 0 and trace["trainable"] is True
    print(mode, scored)
