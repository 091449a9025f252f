"""A rollout that captured nothing, without a harness: the control plane's end of it (404 with the
diagnosis, counted for /metrics) and the runner's naming of the likely cause
(polar_mitm/nemo_gym/captured.py). The real harness that bypasses the proxy is
tests/e2e/test_zero_capture.py."""

from __future__ import annotations

import pytest

from polar_mitm.control import ControlAPI, ControlState
from polar_mitm.nemo_gym.captured import empty_rollout_error, likely_causes

from .test_control import TOKEN, api_call, record, registry

PROXIED = {"HTTPS_PROXY": "http://r.0:polar@10.0.0.5:8080", "NO_PROXY": "localhost,127.0.0.1"}


def test_ending_a_rollout_without_calls_is_refused_and_counted():
    rollouts, written, _ = registry()
    rollouts.call_finished(record("full.0", [1], [99]))
    state = ControlState()
    api = ControlAPI(state, rollouts)
    api.token = TOKEN
    status, obj = api_call(api, "POST", "/v1/rollouts/empty.0/end", {"reward": 1.0})
    assert status == 404 and "zero captured calls" in obj["error"]["message"]
    assert "'empty.0'" in obj["error"]["message"] and state.ended_empty == 1
    assert api_call(api, "POST", "/v1/rollouts/full.0/end", {"reward": 1.0})[0] == 200
    assert state.ended_empty == 1 and len(written) == 1  # a rollout with calls is not counted


@pytest.mark.parametrize(
    ("env", "cause"),
    [
        ({}, "HTTPS_PROXY is not set"),
        ({**PROXIED, "NO_PROXY": "*"}, "NO_PROXY='*' exempts every host"),
        ({**PROXIED, "OPENAI_API_BASE": "http://vllm:8000/v1"}, "OPENAI_API_BASE=http://vllm"),
        (PROXIED, "did not honour HTTPS_PROXY"),
    ],
)
def test_the_likely_cause_is_named(env, cause):
    assert any(cause in c for c in likely_causes(env)), likely_causes(env)
    error = empty_rollout_error("mini-swe-agent", "t.0", env)
    assert error.startswith("rollout t.0: mini-swe-agent finished with zero captured calls")
    assert cause in error and "\n" not in error
