"""A rollout whose harness never went through the proxy is an error, loudly (issue 47, item 4).

The real, pinned Pi runs as a misconfigured rollout container would run it: the rollout's key,
but no proxy variables, and its provider's base URL pointing straight at the policy server. It
does its task (the file is there, a verifier would pass it) and exits 0: exactly the sample that
used to be scored and trained on with nothing in it. The NeMo Gym agent's check
(polar_mitm/nemo_gym/captured.py, run before scoring) must say the rollout captured nothing and
name the missing proxy variables; the control plane's end of that rollout must refuse with the
same diagnosis, and real mitmdump's ``/metrics`` must count one rollout ended empty.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from polar_mitm.control import ControlClient, ControlError
from polar_mitm.nemo_gym.captured import PROXY_VARIABLES, captured_calls, empty_rollout_error
from polar_mitm.nemo_gym.harness import HARNESSES, harness_env, run_harness
from tests.helpers.procs import free_port

from .harnesses import FILE_NAME, FILE_TEXT, FINAL_TEXT, PROMPT
from .test_harnesses import SCENARIO

TOKEN = "zero-capture-control-token"
ROLLOUT = "bypass-task.0"
POLICY_MODEL = json.loads(SCENARIO.read_text())["model"]  # asked for by name, as vLLM wants


@pytest.mark.slow
def test_a_harness_that_bypassed_the_proxy_fails_its_rollout_loudly(
    harness_bin, tmp_path, make_policy_server, make_mitm
):
    server = make_policy_server(SCENARIO)
    port = free_port()
    mitm = make_mitm(
        server.url, polar_control_token=TOKEN, polar_control_listen=f"127.0.0.1:{port}"
    )
    pi = HARNESSES["pi"]
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = harness_env(pi, home, mitm.url, mitm.ca, ROLLOUT, harness_bin)
    for name in (*PROXY_VARIABLES, "HTTP_PROXY", "http_proxy"):
        env.pop(name, None)  # the runner forgot them

    def bypass(home, model, bin_dir):  # Pi's own config, with the policy's URL and model
        pi.configure(home, model, bin_dir)
        models = home / ".pi" / "agent" / "models.json"
        config = json.loads(models.read_text())
        config["providers"]["polar"]["baseUrl"] = server.url + "/v1"
        models.write_text(json.dumps(config))

    misconfigured = dataclasses.replace(pi, configure=bypass)
    ran = asyncio.run(
        run_harness(misconfigured, harness_bin, POLICY_MODEL, PROMPT, work, env, timeout=180)
    )
    log = f"{ran.error}\n--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
    # The masked sample: the harness succeeded, the task is done, the policy was called.
    assert (ran.returncode, ran.error) == (0, None), log
    assert FINAL_TEXT in ran.stdout and (work / FILE_NAME).read_text() == FILE_TEXT, log
    assert httpx.get(server.url + "/_polar/requests", timeout=10).json(), "the policy was called"

    # The runner's check, before scoring: zero captured calls, the cause named.
    control = ControlClient(TOKEN, url=f"http://127.0.0.1:{port}")
    assert captured_calls(control, ROLLOUT) == 0
    error = empty_rollout_error(pi.name, ROLLOUT, env)
    assert "zero captured calls" in error and "HTTPS_PROXY is not set" in error, error
    assert "\n" not in error

    # The control plane's end of it says so, and /metrics counts it.
    with pytest.raises(ControlError) as ended:
        control.end(ROLLOUT, reward=1.0)
    assert ended.value.status == 404 and "zero captured calls" in ended.value.message
    metrics = httpx.get(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert metrics.status_code == 200, metrics.text
    assert "polar_rollouts_ended_empty_total 1.0" in metrics.text, metrics.text
    assert mitm.stop() == 0
