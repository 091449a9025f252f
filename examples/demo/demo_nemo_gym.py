"""polar-mitm as a NeMo Gym environment: a GRPO group of 4 rollouts of one task with the real Pi.

Run by ``./scripts/demo.sh --nemo-gym`` (which sets up .venv, .venv-gym and the harnesses). It
starts the reference policy server (scenario nemo_gym.json: the scripted model fixes calc.py),
mitmdump with the addon and a control token, and Gym's own CLI from the checkout: ``gym env
start`` with the project's agent and coding-task resources server, then ``gym eval run --no-serve
--num-repeats 4`` on the task fix-add. It ends with the collected JSONL summarized (per rollout:
reward, calls, sampled tokens, trainability) and the proxy's view of the GRPO group, and stops
every process it started.

    .venv/bin/python examples/demo/demo_nemo_gym.py HARNESS_BIN_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from polar_mitm.control import ControlClient  # noqa: E402
from polar_mitm.nemo_gym.session import GymSession  # noqa: E402

GYM_VENV = ROOT / ".venv-gym"
CONFIG = ROOT / "resources_servers" / "polar_coding" / "configs" / "polar_coding.yaml"
TASKS = ROOT / "resources_servers" / "polar_coding" / "data" / "tasks.jsonl"
TASK = "fix-add"
REPEATS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, ready: str, env: dict[str, str]) -> subprocess.Popen:
    """A child process whose output goes to `log`; waits until `ready` (a regex) shows there."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not re.search(ready, log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"error: {args[0]} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def main() -> None:
    bin_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = Path(sys.executable).parent
    token = secrets.token_hex(16)  # the control token: in the environment only, never on disk
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    # Ray's socket paths must stay under 108 bytes: a short dir of its own
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env.update(PYTHONPATH=str(ROOT), POLAR_CONTROL_TOKEN=token, RAY_TMPDIR=ray_tmp)
    children: list[subprocess.Popen] = []
    gym = None
    try:
        print("== starting the reference policy server (scenario nemo_gym.json)")
        scenario = ROOT / "reference" / "polar_reference" / "scenarios" / "nemo_gym.json"
        policy_port, proxy_port = free_port(), free_port()
        children.append(
            start(
                [str(py / "python"), "-m", "polar_reference", "--port", str(policy_port),
                 "--scenario", str(scenario)],
                logs / "policy.log", r"policy-server listening", env,
            )
        )  # fmt: skip
        print("== starting mitmdump with the addon")
        confdir = out / "certs"
        children.append(
            start(
                [str(py / "mitmdump"), "-s", str(ROOT / "addons" / "polar.py"),
                 "--listen-host", "127.0.0.1", "--listen-port", str(proxy_port),
                 "--set", f"confdir={confdir}", "--set", f"polar_output={out / 'polar-data'}",
                 "--set", f"polar_upstream=http://127.0.0.1:{policy_port}",
                 "--set", f"polar_control_token={token}", "--set", "polar_keep_ended=64"],
                logs / "mitm.log", r"polar-mitm: capturing", env,
            )
        )  # fmt: skip
        proxy = f"http://127.0.0.1:{proxy_port}"
        agent = "++polar_mitm_agent.responses_api_agents.polar_mitm_agent"
        head = [  # Gym's head server on a free port; Hydra's run folder under OUT
            "++head_server.host=127.0.0.1",
            f"++head_server.port={free_port()}",
            f"hydra.run.dir={out / 'hydra'}",
        ]
        print("== gym env start (Ray, head server, polar_mitm_agent, polar_coding)")
        gym = GymSession(
            [str(GYM_VENV / "bin" / "gym"), "env", "start", "--config", str(CONFIG), *head,
             f"++uv_venv_dir={GYM_VENV / 'servers'}", f"{agent}.proxy={proxy}",
             f"{agent}.ca_cert={confdir / 'mitmproxy-ca-cert.pem'}",
             f"{agent}.harness_bin_dir={bin_dir}", f"{agent}.workspace_root={out / 'workspaces'}"],
            logs / "gym.log", env, ROOT,
        )  # fmt: skip
        gym.wait_ready(300)
        rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
        task_input = out / "task.jsonl"
        task_input.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_id"] == TASK))
        rollouts = out / "rollouts.jsonl"
        print(f"== gym eval run --no-serve --num-repeats {REPEATS} (task {TASK}, real Pi)")
        started = time.monotonic()
        with open(logs / "eval.log", "wb") as eval_log:
            subprocess.run(
                [str(GYM_VENV / "bin" / "gym"), "eval", "run", "--no-serve", "--agent",
                 "polar_mitm_agent", "--input", str(task_input), "--output", str(rollouts),
                 "--num-repeats", str(REPEATS), "--concurrency", str(REPEATS), *head],
                cwd=ROOT, env=env, check=True, stdout=eval_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        print(f"   collected in {time.monotonic() - started:.1f} s: {rollouts}")
        group = next(g for g in ControlClient(token, proxy=proxy).groups() if g["group_id"] == TASK)
        print("== the collected JSONL")
        print(f"{'rollout':<12} {'reward':>6} {'calls':>5} {'sampled':>7} {'trainable':>9}  reason")
        collected = [json.loads(line) for line in rollouts.read_text().splitlines()]
        for r in sorted(collected, key=lambda r: r["polar"]["rollout_id"]):
            items = r["response"]["output"]
            sampled = sum(len(i.get("generation_token_ids") or []) for i in items)
            p = r["polar"]
            print(
                f"{p['rollout_id']:<12} {r['reward']:>6} {len(items):>5} {sampled:>7} "
                f"{str(p.get('trainable')):>9}  {p.get('reason') or ''}"
            )
        samples = [s["rollout_id"] for s in group["samples"].values()]
        print(f"== GRPO group {TASK} on the proxy: {len(samples)} samples {samples}")
    finally:
        if gym is not None:
            killed = gym.stop()
            print(f"== gym stopped ({len(killed)} process(es) killed after the grace period)")
        for proc in reversed(children):
            proc.send_signal(2)
            proc.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
