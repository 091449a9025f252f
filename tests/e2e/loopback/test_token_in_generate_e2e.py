"""polar_token_in=generate end to end: real mitmdump + addon, the reference server imitating vLLM
0.32's ``POST /inference/v1/generate`` (ids only, ``--enable-scale-out``; HTTP 403 without it).

The proxy decodes the sampled ids itself; that the harness sees exactly what the /v1/completions
route gives it, in the three dialects, with the same ids and logprobs in the records, is
`test_exact_prefix_e2e.py`'s `test_cheaper_upstream_modes_stream_the_same_to_the_harness`
(mode generate). Here: a server without the route, and the option's start-up errors.
"""

from __future__ import annotations

import openai
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from tests.e2e.loopback.test_capture_e2e import test_startup_option_errors as startup_errors
from tests.e2e.loopback.test_exact_prefix_e2e import SCENARIO, ask, first_tool_turn, records
from tests.helpers.clients import openai_client


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_generate_route_without_scale_out_fails_naming_the_fix(
    make_policy_server, make_mitm, stream
):
    """vLLM without --enable-scale-out answers 403: the harness gets its dialect's error saying
    what to change, the record says so, and the chain's first (chat) call is unaffected."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(
        server.url,
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_exact_prefix="true",
        polar_token_in="generate",
    )
    with openai_client(mitm, api_key="polar-noscale.0") as client:
        messages = first_tool_turn(client, stream=stream)
        with pytest.raises(openai.APIStatusError) as failed:
            ask(client, messages, stream=stream)
    assert failed.value.status_code == 403
    text = str(failed.value)
    assert "--enable-scale-out" in text and "vLLM >= 0.32" in text and "Scale-out" in text
    assert "polar-mitm sent model" not in text
    assert mitm.stop() == 0
    calls, _ = records(mitm.output, "noscale.0")
    assert [(c["route"], c["status"], c["http_status"]) for c in calls] == [
        ("chat", "completed", 200),
        ("token_in", "error", 403),
    ]
    assert "--enable-scale-out" in calls[1]["error"]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (
            {
                "polar_upstream": "http://127.0.0.1:9",
                "polar_upstream_kind": "sglang",
                "polar_tokenizer": str(qwen3_tokenizer_dir()),
                "polar_exact_prefix": "true",
                "polar_token_in": "generate",
            },
            "polar_token_in=generate: vLLM's /inference/v1/generate needs polar_upstream_kind=vllm",
        ),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_token_in": "tokens"},
            "polar_token_in: 'tokens' is not 'completions' or 'generate'",
        ),
    ],
    ids=["sglang", "unknown"],
)
def test_polar_token_in_startup_errors(tmp_path, confdir, options, needle):
    startup_errors(tmp_path, confdir, options, needle)
