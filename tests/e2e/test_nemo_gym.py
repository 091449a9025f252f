"""polar-mitm as a NeMo Gym environment, through Gym's own CLI, with the real Pi.

NeMo Gym 0.4.0 runs from its own venv (`.venv-gym`, built by scripts/_python.sh's
`polar_gym_venv`; a missing venv fails this test, it never skips). `gym env start` serves the
project's agent (responses_api_agents/polar_mitm_agent) and coding-task resources server
(resources_servers/polar_coding) from the checkout; real mitmdump with the addon sits between the
real Pi and the reference policy server, which plays tests' scenario nemo_gym.json: on fix-add
it fixes the code (reward 1), on fix-greeting it makes a wrong fix (reward 0). `gym eval run
--no-serve --num-repeats 2` collects the rollouts.

What is checked: every output row parses with Gym's own models (in Gym's venv), keeps its token
fields (the ...ForTraining item types) and passes NeMo RL's contiguity rule; its ids and log probs
are the proxy's trace and calls; its reward is the verifier's and the trace's on disk; a task's
two repeats are one GRPO group on the proxy with one prompt (same workspace path). Then three
failing rollouts through the same Gym (a harness that exits non-zero, a time-out, a proxy that is
not there) each come back as reward 0 with a reason. Every process started is stopped: Gym's
whole session (Ray included) is gone at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from polar_reference.scenario import bundled_scenario

from polar_mitm.control import ControlClient
from polar_mitm.nemo_gym.session import GymSession, session_members
from polar_mitm.store import read_table
from tests.helpers import ROOT
from tests.helpers.procs import MITMDUMP, free_port

GYM_VENV = ROOT / ".venv-gym"
GYM = GYM_VENV / "bin" / "gym"
CONFIG = ROOT / "resources_servers" / "polar_coding" / "configs" / "polar_coding.yaml"
TASKS = ROOT / "resources_servers" / "polar_coding" / "data" / "tasks.jsonl"
CHECK = Path(__file__).parent / "gym_check.py"
TOKEN = "gym-e2e-control-token"
AGENT = "polar_mitm_agent"
EXPECTED_REWARD = {"fix-add": 1.0, "fix-greeting": 0.0}
# The agents collected through `gym eval run`: Pi on every task, Claude Code and Codex on fix-add;
# each its own group prefix, so their rollouts are groups of their own on the proxy.
HARNESS_AGENTS = {
    AGENT: ("pi", ""),
    "polar_claude": ("claude", "claude-"),
    "polar_codex": ("codex", "codex-"),
}


def processes_under(folder: Path) -> list[int]:
    """Pids of the processes whose working directory is in `folder`."""
    pids = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)).is_relative_to(folder):
                pids.append(int(cwd.parent.name))
        except OSError:
            continue
    return pids


def overlay(
    tmp: Path,
    mitm_url: str,
    ca: Path,
    ports: dict[str, int],
    bin_dir: Path,
    fake_bin: Path,
    upstream: str,
) -> Path:
    """The run's values on top of the shipped config, the Claude and Codex agents, and three
    agents that must fail."""
    agent = {
        "proxy": mitm_url,
        "ca_cert": str(ca),
        "workspace_root": str(tmp / "ws"),
        "harness_bin_dir": str(bin_dir),
    }
    agents = {
        "polar_fail": {"harness_bin_dir": str(fake_bin), "group_prefix": "fail-"},
        # a harness that hangs (with a child of its own): killed, group and all, at 1 s; the
        # real Pi can finish a scripted task in less than that
        "polar_timeout": {
            "harness_bin_dir": str(fake_bin / "hang"),
            "timeout_s": 1.0,
            "group_prefix": "timeout-",
        },
        "polar_noproxy": {
            "proxy": f"http://127.0.0.1:{free_port()}",
            "timeout_s": 90.0,
            "group_prefix": "noproxy-",
        },
        # a proxy of its own, started by the agent on its first /run
        "polar_ownproxy": {
            "proxy": None,
            "ca_cert": None,
            "start_proxy": {"mitmdump": MITMDUMP, "upstream": upstream, "folder": str(tmp / "own")},
            "group_prefix": "own-",
        },
    }
    for name, (harness, prefix) in HARNESS_AGENTS.items():
        if name != AGENT:
            agents[name] = {"harness": harness, "group_prefix": prefix}
    config = {
        "uv_venv_dir": str(GYM_VENV / "servers"),
        "head_server": {"host": "127.0.0.1", "port": ports["head"]},
        "polar_coding": {"resources_servers": {"polar_coding": {"port": ports["polar_coding"]}}},
        AGENT: {"responses_api_agents": {AGENT: {**agent, "port": ports[AGENT], "concurrency": 2}}},
    }
    for name, values in agents.items():
        config[name] = {
            "responses_api_agents": {
                AGENT: {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "polar_coding"},
                    "port": ports[name],
                    **agent,
                    **values,
                }
            }
        }
    path = tmp / "overlay.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def gym_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(
        PYTHONPATH=str(ROOT),  # the servers import this tree's polar_mitm
        POLAR_CONTROL_TOKEN=TOKEN,
        # Ray's socket paths must stay under 108 bytes: a short dir of its own
        RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"),
        HOME=str(tmp / "home"),
    )
    (tmp / "home").mkdir()
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gym_collects_pi_rollouts_through_polar_mitm(
    harness_bin, tmp_path, make_policy_server, make_mitm
):
    if not GYM.exists():
        pytest.fail(
            f"no NeMo Gym venv at {GYM_VENV}: scripts/test.sh builds it "
            "(source scripts/_python.sh && polar_gym_venv .venv-gym)",
            pytrace=False,
        )
    server = make_policy_server(bundled_scenario("nemo_gym"))
    mitm = make_mitm(server.url, polar_control_token=TOKEN, polar_keep_ended=64)
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "pi").write_text("#!/bin/sh\necho 'pi: cannot reach the provider' >&2\nexit 3\n")
    (fake_bin / "pi").chmod(0o755)
    (fake_bin / "hang").mkdir()
    (fake_bin / "hang" / "pi").write_text("#!/bin/sh\nsleep 120 &\nwait\n")
    (fake_bin / "hang" / "pi").chmod(0o755)
    names = [
        *HARNESS_AGENTS,
        "polar_fail",
        "polar_timeout",
        "polar_noproxy",
        "polar_ownproxy",
        "polar_coding",
        "head",
    ]
    ports = {name: free_port() for name in names}
    extra = overlay(tmp_path, mitm.url, mitm.ca, ports, harness_bin, fake_bin, server.url)
    env = gym_env(tmp_path)
    # Gym's head server on a free port; Hydra's run folder (it logs the merged config) in tmp
    head = [
        "++head_server.host=127.0.0.1",
        f"++head_server.port={ports['head']}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    gym = GymSession(
        [str(GYM), "env", "start", "--config", str(CONFIG), "--config", str(extra), *head],
        tmp_path / "gym.log",
        env,
        ROOT,
    )
    try:
        t0 = time.monotonic()
        gym.wait_ready(300)
        up_s = time.monotonic() - t0
        out = tmp_path / "rollouts.jsonl"
        tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
        rows_in = [
            {**t, "agent_ref": {"type": "responses_api_agents", "name": AGENT}} for t in tasks
        ]
        rows_in += [
            {**t, "agent_ref": {"type": "responses_api_agents", "name": name}}
            for name in HARNESS_AGENTS
            if name != AGENT
            for t in tasks
            if t["task_id"] == "fix-add"
        ]
        inputs = tmp_path / "inputs.jsonl"
        inputs.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
        started = time.monotonic()
        collected = subprocess.run(
            [str(GYM), "eval", "run", "--no-serve", "--input", str(inputs),
             "--output", str(out), "--num-repeats", "2", "--concurrency", "2", *head],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        collect_s = time.monotonic() - started
        assert collected.returncode == 0, collected.stdout[-4000:] + collected.stderr[-4000:]
        groups = {g["group_id"]: g for g in ControlClient(TOKEN, proxy=mitm.url).groups()}

        # The failure cases, each one /run on its own agent, as Gym's collection posts it.
        row = json.loads(TASKS.read_text().splitlines()[0])
        failed = {}
        t0 = time.monotonic()
        for name in ("polar_fail", "polar_timeout", "polar_noproxy", "polar_ownproxy"):
            r = httpx.post(
                f"http://127.0.0.1:{ports[name]}/run",
                json={**row, "_ng_task_index": 0, "_ng_rollout_index": 0},
                timeout=180,
            )
            assert r.status_code == 200, r.text
            failed[name] = r.json()
        fail_s = time.monotonic() - t0
    finally:
        killed = gym.stop()
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert session_members(gym.proc.pid) == [], "Gym's processes outlived the stop"
    # No harness (nor a child of one: the timed-out Pi's process group) is left in a workspace.
    assert processes_under(tmp_path / "ws") == []
    assert mitm.stop() == 0, mitm.proc.output()

    # Gym's own models parse every row and keep the token fields; NeMo RL's contiguity holds.
    check = subprocess.run(
        [str(GYM_VENV / "bin" / "python"), str(CHECK), str(out)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 * len(rows_in) == 8 and json.loads(check.stdout)["rows"] == 8

    calls = {c["call_id"]: c for c in read_table(str(mitm.output), "calls").to_pylist()}
    traces = read_table(str(mitm.output), "traces").to_pylist()
    by_rollout = {
        t["rollout_id"]: t for t in traces if t["role"] == "main" and not t["parent_trace_id"]
    }
    first_prompts: dict[str, set] = {}
    for row in rows:
        task, sample = row["task_id"], row["_ng_rollout_index"]
        harness, prefix = HARNESS_AGENTS[row["agent_ref"]["name"]]
        group = prefix + task
        rollout_id = f"{group}.{sample}"
        polar = row["polar"]
        assert polar["rollout_id"] == rollout_id and polar["group_id"] == group
        assert polar["harness"] == harness
        assert polar["harness_returncode"] == 0, polar
        # The reward is the verifier's, the scenario's, and what the proxy wrote on the trace.
        assert row["reward"] == EXPECTED_REWARD[task] == polar["reward"], row
        assert row["test_passed"] is (row["reward"] == 1.0)
        assert (row["reason"] is None) is (row["reward"] == 1.0), row["reason"]
        trace = by_rollout[rollout_id]
        assert (trace["reward"], trace["status"]) == (row["reward"], "completed")
        assert trace["trainable"] is True and polar["trainable"] is True
        assert polar["trace_id"] == trace["trace_id"] == row["response"]["id"]
        # The items are the trace: one per call, its prompt, sampled ids and log probs.
        items = row["response"]["output"]
        assert [i["id"] for i in items] == trace["call_ids"] and len(items) == 2
        for item in items:
            call = calls[item["id"]]
            assert item["prompt_token_ids"] == call["prompt_token_ids"]
            assert item["generation_token_ids"] == call["output_token_ids"]
            assert item["generation_log_probs"] == pytest.approx(call["output_logprobs"], abs=1e-6)
        last = items[-1]
        assert last["prompt_token_ids"] + last["generation_token_ids"] == trace["input_ids"]
        first_prompts.setdefault(group, set()).add(tuple(items[0]["prompt_token_ids"]))
        assert trace["group_id"] == group and trace["sample_index"] == sample
    # One GRPO group per task on the proxy, with both repeats, and one prompt (same path).
    want = {t: r for t, r in EXPECTED_REWARD.items()}
    want.update({f"{p}fix-add": 1.0 for _, p in HARNESS_AGENTS.values() if p})
    for group, reward in want.items():
        samples = groups[group]["samples"]
        assert {k: (v["rollout_id"], v["reward"]) for k, v in samples.items()} == {
            "0": (f"{group}.0", reward),
            "1": (f"{group}.1", reward),
        }, groups[group]
        assert len(first_prompts[group]) == 1, group

    # Failures: reward 0 with a reason, a parseable (empty or partial) response.
    assert failed["polar_fail"]["reward"] == 0.0
    assert "pi exited 3: pi: cannot reach the provider" in failed["polar_fail"]["polar"]["reason"]
    assert failed["polar_timeout"]["reward"] == 0.0
    assert "timed out after 1 s" in failed["polar_timeout"]["polar"]["reason"]
    noproxy = failed["polar_noproxy"]["polar"]
    assert failed["polar_noproxy"]["reward"] == 0.0 and noproxy["reason"], noproxy
    assert noproxy["harness_returncode"] not in (0, None), noproxy
    assert "proxy control plane" in noproxy["control_error"], noproxy
    own = failed.pop("polar_ownproxy")
    assert (own["reward"], own["polar"]["reason"], own["polar"]["trainable"]) == (1.0, None, True)
    [own_trace] = read_table(str(tmp_path / "own" / "polar-data"), "traces").to_pylist()
    assert (own_trace["rollout_id"], own_trace["reward"]) == ("own-fix-add.0", 1.0)
    assert [i["id"] for i in own["response"]["output"]] == own_trace["call_ids"]
    for result in failed.values():
        assert result["response"]["output"] == [] or result["polar"].get("trace_id")
    reasons = {name: r["polar"]["reason"] for name, r in failed.items()}
    print(f"gym up {up_s:.1f} s, collect {collect_s:.1f} s, failures {fail_s:.1f} s; {reasons}")
    print(f"killed after the grace period: {len(killed)}")
