"""Servers that return no token ids: the proxy retokenizes, verifies against usage, and flags.

Real processes, as in test_capture_e2e.py: the reference policy server with --ignore-token-flags
behaves like a vLLM < 0.10.2 or an SGLang from before the id flags (it answers normally and leaves
the ids out); `polar_upstream_kind=openai` is a plain OpenAI-compatible server. A second server
with the flags honoured gives the truth the retokenized ids are compared with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.cli.app import main as cli_main
from tests.e2e.loopback.test_capture_e2e import SCENARIO, calls_of
from tests.helpers.clients import RUN_SHELL, http_client, openai_client, run_tool_conversation
from tests.helpers.upstreams import direct_ids, expected_prompt_ids

WARNING = "returned no token ids"


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


@pytest.mark.parametrize(
    ("kind", "stream"), [("vllm", True), ("sglang", False)], ids=["vllm-stream", "sglang-json"]
)
def test_server_ignoring_token_flags_is_retokenized(
    make_policy_server, make_mitm, qwen3, kind, stream
):
    old = make_policy_server(SCENARIO, "--ignore-token-flags", kind=kind)
    truth_server = make_policy_server(SCENARIO, kind=kind)
    mitm = make_mitm(old.url, polar_upstream_kind=kind, polar_tokenizer=qwen3_tokenizer_dir())
    sent, replies = run_tool_conversation(openai_client(mitm, api_key="polar-old.0"), stream=stream)
    assert [r["finish_reason"] for r in replies] == ["tool_calls", "tool_calls", "stop"]
    rows = calls_of(mitm)
    assert len(rows) == 3
    for messages, row in zip(sent, rows, strict=True):
        truth = direct_ids(truth_server.url, kind, messages, [RUN_SHELL])
        assert row["status"] == "completed" and row["upstream_kind"] == kind
        assert row["ids_source"] == "retokenized"
        assert row["prompt_token_ids"] == truth.prompt_ids
        assert row["prompt_token_ids"] == expected_prompt_ids(qwen3, kind, messages, [RUN_SHELL])
        assert row["output_token_ids"] == truth.output_ids
        assert row["output_logprobs"] == pytest.approx(truth.logprobs, abs=1e-6)
        assert row["usage_prompt_tokens"] == len(row["prompt_token_ids"])
        assert row["usage_completion_tokens"] == len(row["output_token_ids"])
        assert row["count_check"] == "ok"
        # the client sends replies back without their reasoning: the fidelity checks flag the
        # re-render (tests/test_fidelity.py); the fallback's own flag comes first
        assert row["fidelity_flags"][0] == "retokenized"
        assert set(row["fidelity_flags"][1:]) <= {"template_rerender", "reasoning_dropped"}
        assert row["trainable"] is False  # polar_trust_retokenized is off
        detail = json.loads(row["fidelity_json"])["retokenized"]
        assert detail["prompt"] == {
            "source": "retokenized",
            "tokens": len(truth.prompt_ids),
            "usage": len(truth.prompt_ids),
            "check": "ok",
        }
        assert detail["flavor"] == kind and detail["template_continuation"] is True
    log = mitm.proc.output()
    assert log.count(WARNING) == 1, log  # once per upstream, not per call
    summary = CliRunner().invoke(cli_main, ["summary", str(mitm.output), "--json"])
    assert summary.exit_code == 0, summary.output
    [rollout] = json.loads(summary.output)["rollouts"]
    assert rollout["rollout_id"] == "old.0" and rollout["retokenized"] == 3


def test_openai_kind_with_trust_is_trainable(make_policy_server, make_mitm):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url,
        polar_upstream_kind="openai",
        polar_tokenizer=qwen3_tokenizer_dir(),
        polar_trust_retokenized="true",
    )
    messages = [{"role": "user", "content": "How many lines does notes.txt have?"}]
    with http_client(mitm) as c:
        r = c.post(
            "https://api.openai.com/v1/chat/completions",
            json={"model": "gpt-4.1-mini", "messages": messages, "tools": [RUN_SHELL]},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    [sent] = [e["body"] for e in _requests(server.url)]
    assert not {"return_token_ids", "logprobs"} & set(sent), "kind openai must not ask for ids"
    [row] = calls_of(mitm)
    truth = direct_ids(server.url, "vllm", messages, [RUN_SHELL])
    assert row["ids_source"] == "retokenized" and row["count_check"] == "ok"
    assert row["prompt_token_ids"] == truth.prompt_ids
    assert row["output_token_ids"] == truth.output_ids
    assert row["output_logprobs"] == []
    assert row["trainable"] is True
    assert WARNING not in mitm.proc.output()  # expected for this kind: said once at start-up only


def test_a_different_template_is_flagged(make_policy_server, make_mitm, tmp_path):
    """The policy tokenizer's template differs from the server's: the prompt count disagrees
    with usage, the record says so, and even polar_trust_retokenized does not make it trainable."""
    altered = tmp_path / "altered-tokenizer"
    shutil.copytree(qwen3_tokenizer_dir(), altered)
    config_path = altered / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{{- 'A preamble the server never rendered.\\n' }}" + config["chat_template"]
    )
    config_path.write_text(json.dumps(config))
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url,
        polar_upstream_kind="openai",
        polar_tokenizer=altered,
        polar_trust_retokenized="true",
    )
    with http_client(mitm) as c:
        r = c.post(
            "https://api.openai.com/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "How many lines?"}],
                "tools": [RUN_SHELL],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200
        chunks = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
        ]
        usage = [c["usage"] for c in chunks if not c.get("choices") and c.get("usage")]
        assert len(usage) == 1, "the harness asked for the usage chunk"
    [row] = calls_of(mitm)
    assert row["ids_source"] == "retokenized"
    assert len(row["prompt_token_ids"]) > row["usage_prompt_tokens"]
    assert row["count_check"] == "mismatch"
    assert "prompt_count_mismatch" in row["fidelity_flags"]
    assert "count_mismatch" not in row["fidelity_flags"]  # the reply itself renders the same
    assert row["trainable"] is False
    detail = json.loads(row["fidelity_json"])["retokenized"]
    assert detail["prompt"]["check"] == "mismatch" and detail["output"]["check"] == "ok"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_auto_kind_probes_once(make_policy_server, make_mitm, kind):
    """auto finds the kind from GET /v1/models; an old server without a policy tokenizer leaves
    records without ids, flagged, with one warning that says how to fix it."""
    server = make_policy_server(SCENARIO, "--ignore-token-flags", kind=kind)
    mitm = make_mitm(server.url, polar_upstream_kind="auto")
    log = mitm.proc.output()
    assert (
        f"polar_upstream_kind=auto: {server.url} is {kind} (GET /v1/models: owned_by={kind})" in log
    )
    with http_client(mitm) as c:
        for _ in range(2):
            r = c.post(
                "https://api.openai.com/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200, r.text
    rows = calls_of(mitm)
    assert [r["upstream_kind"] for r in rows] == [kind, kind]
    assert all(
        r["ids_source"] == "none"
        and "missing_token_ids" in r["fidelity_flags"]
        and r["trainable"] is False
        for r in rows
    )
    log = mitm.proc.output()
    assert log.count(WARNING) == 1 and "set polar_tokenizer" in log


def _requests(server_url: str) -> list[dict]:
    import httpx

    log = httpx.get(server_url + "/_polar/requests", timeout=10).json()
    return [e for e in log if e["path"] == "/v1/chat/completions"]


def test_bad_kind_lists_the_new_ones(tmp_path: Path, confdir):
    from tests.helpers import ROOT
    from tests.helpers.procs import MITMDUMP, Proc, free_port

    args = [
        MITMDUMP,
        "-s",
        str(ROOT / "addons" / "polar.py"),
        "--listen-port",
        str(free_port()),
        "--set",
        f"confdir={confdir}",
        "--set",
        f"polar_output={tmp_path / 'out'}",
        "--set",
        "polar_upstream=http://127.0.0.1:9",
        "--set",
        "polar_upstream_kind=tgi",
    ]
    proc = Proc(args, tmp_path / "mitm.log")
    proc.popen.wait(60)
    out = proc.output()
    assert proc.popen.returncode != 0
    assert "choose from vllm, sglang, openai, auto" in out and "Traceback" not in out
