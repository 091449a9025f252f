"""The NeMo Gym agent's `harness: gemini` entry without Gym: what the agent does per `/run`
(polar_mitm/nemo_gym/agent.py), step by step with its own functions, for Gemini CLI.

The coding task fix-add is seeded into a fresh workspace; `harness_env` + `run_harness` run the
real, pinned Gemini CLI through real mitmdump to the reference server playing the bundled
nemo_gym scenario (its router's call answered with the JSON it wants, the agent loop fixing
calc.py with run_shell_command); the verifier scores the workspace; the rollout is ended through
the control plane; its main trace (not the router's side chain) becomes the Gym output items.
The agent itself, inside Gym, is tests/e2e/test_nemo_gym.py (minutes: Ray); Pi, Claude Code and
Codex are run there.
"""

from __future__ import annotations

import asyncio

import pytest
from polar_reference.scenario import bundled_scenario

from polar_mitm.control import ControlClient
from polar_mitm.nemo_gym.coding_tasks import load_task, seed, verify
from polar_mitm.nemo_gym.harness import DEFAULT_MODEL, HARNESSES, harness_env, run_harness
from polar_mitm.nemo_gym.items import output_items
from polar_mitm.trajectory.traceview import main_trace

TOKEN = "gym-harness-control-token"


@pytest.mark.slow
def test_gemini_entry_runs_a_task_to_a_trainable_trace(
    harness_bin, tmp_path, make_policy_server, make_mitm
):
    server = make_policy_server(bundled_scenario("nemo_gym"))
    mitm = make_mitm(server.url, polar_control_token=TOKEN)
    task = load_task("fix-add")
    work, home = tmp_path / "ws" / "work", tmp_path / "ws" / "home"
    seed(task, work)
    home.mkdir(parents=True)
    harness = HARNESSES["gemini"]
    rollout = "gemini-fix-add.0"
    env = harness_env(harness, home, mitm.url, mitm.ca, rollout, harness_bin)
    assert env["GEMINI_API_KEY"] == f"polar-{rollout}"
    assert env["GEMINI_CLI_TRUST_WORKSPACE"] == "true" and rollout in env["HTTPS_PROXY"]
    ran = asyncio.run(
        run_harness(harness, harness_bin, DEFAULT_MODEL, task.prompt, work, env, timeout=240)
    )
    log = f"{ran.error}\n--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
    assert (ran.returncode, ran.error) == (0, None), log
    assert "I changed the code" in ran.stdout, log
    verdict = verify(task, work, timeout=60)
    assert (verdict.reward, verdict.reason) == (1.0, None), verdict.output

    control = ControlClient(TOKEN, proxy=mitm.url)
    ended = control.end(rollout, verdict.reward, "completed")
    assert (ended["status"], ended["reward"], ended["calls"]) == ("completed", 1.0, 3)
    traces = control.traces(rollout)["traces"]
    assert sorted(t["role"] for t in traces) == ["main", "side"]  # the router's call: side
    trace = main_trace(traces)
    assert trace["role"] == "main" and trace["trainable"] is True, trace["untrainable_reason"]
    assert (trace["status"], trace["reward"]) == ("completed", 1.0)
    items = output_items(trace)
    assert [i["id"] for i in items] == trace["call_ids"] and len(items) == 2
    first, second = items
    # NeMo RL's contiguity rule: each call's prompt starts with the previous prompt + output
    sampled = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(sampled)] == sampled
    assert all(len(i["generation_token_ids"]) == len(i["generation_log_probs"]) > 0 for i in items)
    assert mitm.stop() == 0
