"""Running one unmodified harness (Pi, Claude Code, Codex, Qwen Code, OpenCode, Gemini CLI, ...)
through polar-mitm, for one rollout.

The harness gets what a rollout container would: a fresh workspace and HOME with its config
files, the environment `polar-mitm env` prints (proxy URL with the rollout id as its user name,
the CA variables), an API key ``polar-<rollout id>``, PATH (the harness install's bin dir first:
it holds the Node.js the harnesses need when the machine's is older, see
scripts/install_harnesses.sh) and TERM; nothing else from the calling process (the Gym server's
environment holds Gym's whole merged config). These configurations are the README's, and the ones
the e2e tests run (tests/e2e/harnesses.py builds on this table). It runs in a process group of its
own, so a timeout kills the harness and every child it started (its shell tools), not just the
node process. Standard library only: this runs inside NeMo Gym's venv.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..certs import env_lines

# The model name each harness asks for; the proxy replaces it with the policy's.
DEFAULT_MODEL = "gpt-4.1-mini"
# Where scripts/install_harnesses.sh puts the pinned harnesses (it honours the same variables:
# POLAR_HARNESS_PINS=previous installs the previous release's pins beside them).
DEFAULT_BIN_DIR = (
    Path(
        str(
            os.environ.get("POLAR_HARNESS_DIR")
            or Path.home() / ".cache" / "polar-mitm" / "npm-harnesses"
        )
        + ("-previous" if os.environ.get("POLAR_HARNESS_PINS") == "previous" else "")
    )
    / "node_modules"
    / ".bin"
)
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Where scripts/install_py_harnesses.sh puts the PyPI harnesses, a venv each: <dir>/<name>/bin.
DEFAULT_PY_DIR = Path(
    os.environ.get("POLAR_PY_HARNESS_DIR") or Path.home() / ".cache" / "polar-mitm" / "py-harnesses"
)


OPENAI_BASE_URL = "https://api.openai.com/v1"  # the real host: the proxy captures it there


def pi_api_key(bin_dir: Path) -> str:
    """How Pi's models.json names the variable that holds the key. Pi 1.x (`@earendil-works`)
    reads `apiKey` as a literal with `$NAME` / `${NAME}` interpolation or a `!command`, so a bare
    name would be sent as the key itself; the deprecated `@mariozechner` 0.x (the previous pins)
    reads a bare name as a variable and `$NAME` as a literal."""
    legacy = "@mariozechner" in Path(bin_dir, "pi").resolve().parts
    return "OPENAI_API_KEY" if legacy else "$OPENAI_API_KEY"


def _pi_configure(home: Path, model: str, bin_dir: Path) -> None:
    """Pi reads its providers from ~/.pi/agent/models.json: one OpenAI-compatible provider
    whose key is in OPENAI_API_KEY, at the real host."""
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": OPENAI_BASE_URL,
        "api": "openai-completions",
        "apiKey": pi_api_key(bin_dir),
        "models": [{"id": model}],
    }
    (agent / "models.json").write_text(json.dumps({"providers": {"polar": provider}}, indent=2))


def _qwen_configure(home: Path, model: str, bin_dir: Path) -> None:
    """Qwen Code reads ~/.qwen/settings.json: usage statistics off (else every run posts them to
    Alibaba Cloud RUM, a host the proxy does not capture)."""
    folder = home / ".qwen"
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"privacy": {"usageStatisticsEnabled": False}}
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))


def _opencode_configure(home: Path, model: str, bin_dir: Path) -> None:
    """OpenCode reads ~/.config/opencode/opencode.json: one provider through its bundled
    `@ai-sdk/openai-compatible` (chat completions) at the real host, the key from
    OPENAI_API_KEY (`{env:NAME}` is OpenCode's substitution), and that provider's model as the
    default. Sharing and auto-update off: a rollout publishes nothing and installs nothing."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "polar": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "polar",
                "options": {"baseURL": OPENAI_BASE_URL, "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: {"name": model}},
            }
        },
        "model": f"polar/{model}",
        "share": "disabled",
        "autoupdate": False,
    }
    folder = home / ".config" / "opencode"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "opencode.json").write_text(json.dumps(config, indent=2))


def _kilo_configure(home: Path, model: str, bin_dir: Path) -> None:
    """Kilo Code CLI is OpenCode's fork: the same configuration, read from
    ~/.config/kilo/kilo.json."""
    _opencode_configure(home, model, bin_dir)
    folder = home / ".config" / "kilo"
    folder.mkdir(parents=True, exist_ok=True)
    (home / ".config" / "opencode" / "opencode.json").rename(folder / "kilo.json")


def _aider_configure(home: Path, model: str, bin_dir: Path) -> None:
    """Aider reads ~/.aider.model.metadata.json (LiteLLM's model-info shape): the model's
    context and a zero price. Without an entry for the model it fetches LiteLLM's price map from
    raw.githubusercontent.com (aider's own ModelInfoManager; LITELLM_LOCAL_MODEL_COST_MAP does not
    stop it), a host outside the capture, and warns that the model is unknown."""
    info = {
        "max_input_tokens": 32768,
        "max_output_tokens": 8192,
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
    metadata = {f"openai/{model}": info}
    (home / ".aider.model.metadata.json").write_text(json.dumps(metadata, indent=2))


def _openclaw_configure(home: Path, model: str, bin_dir: Path) -> None:
    """OpenClaw reads ~/.openclaw/openclaw.json: one custom provider on OpenAI's Responses API at
    the real host, its key from OPENAI_API_KEY (`${NAME}` is OpenClaw's substitution), and its
    model as the default. A custom provider, not the built-in `openai/...`: OpenClaw's own OpenAI
    provider at api.openai.com sends `store: true` and, whenever a request's history is the
    previous request plus the reply's output items verbatim, only the new input with
    `previous_response_id` (its "HTTP continuation"), which a proxy that keeps no responses
    refuses; a custom provider never continues (`store: false`, the whole history each call),
    and its catalogue is this config (any model name; docs/harnesses.md, "OpenClaw")."""
    provider = {
        "baseUrl": OPENAI_BASE_URL,
        "api": "openai-responses",
        "apiKey": "${OPENAI_API_KEY}",
        "models": [
            {
                "id": model,
                "name": model,
                "reasoning": True,
                "input": ["text"],
                "contextWindow": 32768,
                "maxTokens": 8192,
            }
        ],
    }
    config = {
        "models": {"providers": {"polar": provider}},
        "agents": {"defaults": {"model": {"primary": f"polar/{model}"}}},
    }
    folder = home / ".openclaw"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openclaw.json").write_text(json.dumps(config, indent=2))


# Placeholders in a harness's arguments, filled in for each run.
MODEL, PROMPT = "{model}", "{prompt}"


@dataclass(frozen=True)
class Harness:
    name: str
    binary: str
    key_variable: str
    args: tuple[str, ...]  # after the binary; MODEL and PROMPT are filled in per run
    # (HOME, model, bin dir): the harness's config files, written before each run
    configure: Callable[[Path, str, Path], None] = lambda home, model, bin_dir: None
    extra_env: dict[str, str] = field(default_factory=dict)
    venv: str | None = None  # a PyPI harness: its venv's name under DEFAULT_PY_DIR
    # an npm harness installed apart, on a Node.js of its own (OpenClaw's Node 24): the install
    # dir's suffix (scripts/install_harnesses.sh puts it beside the others', "<dir>-openclaw")
    npm_set: str | None = None

    def bin_dir(self, bin_dir: Path) -> Path:
        """The bin dir that goes first on the harness's PATH (its Node.js is there): the npm
        install's, or the install of its own beside it."""
        if self.npm_set is None:
            return bin_dir
        root = bin_dir.parent.parent
        return root.with_name(f"{root.name}-{self.npm_set}") / "node_modules" / ".bin"

    def executable(self, bin_dir: Path) -> Path:
        """The npm install's bin dir holds the npm harnesses; a PyPI one is in its own venv."""
        if self.venv is not None:
            return DEFAULT_PY_DIR / self.venv / "bin" / self.binary
        return self.bin_dir(bin_dir) / self.binary

    def argv(self, bin_dir: Path, model: str, prompt: str) -> list[str]:
        fill = {MODEL: model, PROMPT: prompt}
        return [str(self.executable(bin_dir)), *(fill.get(a, a) for a in self.args)]


HARNESSES: dict[str, Harness] = {
    "pi": Harness(
        "pi",
        "pi",
        "OPENAI_API_KEY",
        ("--provider", "polar", "--model", MODEL, "-p", PROMPT),
        configure=_pi_configure,
    ),
    "codex": Harness(
        "codex",
        "codex",
        "OPENAI_API_KEY",  # Codex sends none: its rollout id is the proxy credentials
        ("exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", PROMPT),
    ),
    "claude": Harness(
        "claude",
        "claude",
        "ANTHROPIC_API_KEY",
        ("-p", "--dangerously-skip-permissions", PROMPT),
        # As root, --dangerously-skip-permissions is refused unless told it is in a sandbox.
        extra_env={"IS_SANDBOX": "1"},
    ),
    "qwen": Harness(
        "qwen",
        "qwen",
        "OPENAI_API_KEY",
        ("--yolo", "--auth-type", "openai", "--model", MODEL, PROMPT),
        configure=_qwen_configure,
        # Qwen Code's OpenAI auth: chat completions at OPENAI_BASE_URL with OPENAI_API_KEY.
        extra_env={"OPENAI_BASE_URL": OPENAI_BASE_URL},
    ),
    "opencode": Harness(
        "opencode",
        "opencode",
        "OPENAI_API_KEY",
        ("run", PROMPT),
        configure=_opencode_configure,
        # No fetch of OpenCode's model catalogue (models.opencode.ai): the provider is in the
        # config, and the host is outside the proxy's capture.
        extra_env={"OPENCODE_DISABLE_MODELS_FETCH": "1"},
    ),
    "gemini": Harness(
        "gemini",
        "gemini",
        "GEMINI_API_KEY",  # sent as x-goog-api-key
        ("--yolo", "-p", PROMPT),
        # Headless runs refuse an untrusted workspace (the fresh one) without this.
        extra_env={"GEMINI_CLI_TRUST_WORKSPACE": "true"},
    ),
    "mini-swe-agent": Harness(
        "mini-swe-agent",
        "mini",
        "OPENAI_API_KEY",
        # LiteLLM's OpenAI provider at its default host; mini.yaml is the packaged config,
        # --exit-immediately ends the run at the agent's COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT.
        ("--yolo", "--model", "openai/" + MODEL, "--cost-limit", "0", "--exit-immediately")
        + ("-c", "mini.yaml", "--task", PROMPT),
        extra_env={
            "MSWEA_CONFIGURED": "true",  # no first-run wizard
            "MSWEA_COST_TRACKING": "ignore_errors",  # the policy's name has no price
            # else LiteLLM fetches its price map from GitHub at import (outside the capture)
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        },
        venv="mini-swe-agent",
    ),
    "openhands": Harness(
        "openhands",
        "python",
        "OPENAI_API_KEY",
        (str(Path(__file__).with_name("openhands_runner.py")), MODEL, PROMPT),
        extra_env={"OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        venv="openhands",
    ),
    "hermes": Harness(
        "hermes",
        "hermes",
        "OPENAI_API_KEY",
        # -z: one shot, the final answer on stdout; the custom provider at the real host (its
        # key is OPENAI_API_KEY because the host is OpenAI's)
        ("--provider", "custom", "--model", MODEL, "--yolo", "-z", PROMPT),
        extra_env={"CUSTOM_BASE_URL": OPENAI_BASE_URL},
        venv="hermes",
    ),
    "cline": Harness(
        "cline",
        "cline",
        "OPENAI_API_KEY",
        # the OpenAI-compatible provider: chat completions at api.openai.com/v1, its key from
        # OPENAI_API_KEY; act mode, every tool auto-approved (the default with a prompt)
        ("--provider", "openai-compatible", "--model", MODEL, PROMPT),
    ),
    "kilo": Harness(
        "kilo",
        "kilo",
        "OPENAI_API_KEY",
        ("run", PROMPT),
        configure=_kilo_configure,
        # OpenCode's switches under Kilo's names: no model catalogue fetch, no update check
        extra_env={
            "KILO_DISABLE_MODELS_FETCH": "1",
            "KILO_DISABLE_AUTOUPDATE": "1",
            "KILO_TELEMETRY_LEVEL": "off",  # PostHog events: sent only when "all"
        },
    ),
    "aider": Harness(
        "aider",
        "aider",
        "OPENAI_API_KEY",
        # LiteLLM's OpenAI provider at its default host; one LLM call per --message, its reply
        # the file in the whole-file edit format; every confirmation answered yes (shell
        # commands the model suggests are not run: they need an explicit yes); no git (so no
        # commit message from the weak model), no update check, no analytics.
        ("--model", "openai/" + MODEL, "--edit-format", "whole", "--yes-always", "--no-git")
        + ("--no-check-update", "--analytics-disable", "--message", PROMPT),
        configure=_aider_configure,
        # else LiteLLM fetches its price map from GitHub at import (outside the capture)
        extra_env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        venv="aider",
    ),
    "openclaw": Harness(
        "openclaw",
        "openclaw",
        "OPENAI_API_KEY",
        # `agent exec`: one embedded agent turn, no Gateway, a temp state dir removed after; the
        # model is the config's default (its custom provider at the real host)
        ("agent", "exec", PROMPT),
        configure=_openclaw_configure,
        npm_set="openclaw",
    ),
}


@dataclass
class HarnessRun:
    returncode: int | None  # None: it did not start, or was killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    error: str | None  # why the run is not a success, in one line; None when it exited 0


def harness_env(
    harness: Harness, home: Path, proxy: str, ca_cert: Path, rollout_id: str, bin_dir: Path
) -> dict[str, str]:
    """The harness's whole environment: `polar-mitm env` with the rollout id in the proxy URL
    (Codex sends no key), the key ``polar-<rollout id>`` (the others), HOME, PATH, TERM."""
    env = {"HOME": str(home), "PATH": f"{harness.bin_dir(bin_dir)}:{SYSTEM_PATH}", "TERM": "dumb"}
    for line in env_lines(proxy, ca_cert, rollout_id):
        name, _, value = line[len("export ") :].partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    env[harness.key_variable] = f"polar-{rollout_id}"
    env.update(harness.extra_env)
    return env


async def run_harness(
    harness: Harness,
    bin_dir: Path,
    model: str,
    prompt: str,
    workdir: Path,
    env: dict[str, str],
    timeout: float,
) -> HarnessRun:
    """Run the harness in `workdir` to completion or `timeout`; never raises for the harness's
    own failures (a missing binary, a non-zero exit, a time-out: each is `error`)."""
    harness.configure(Path(env["HOME"]), model, bin_dir)
    argv = harness.argv(bin_dir, model, prompt)
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,  # codex exec waits for more input on an open stdin
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: a time-out kills its children too
        )
    except OSError as e:
        return HarnessRun(None, "", "", 0.0, f"{harness.name} could not start ({argv[0]}): {e}")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        kill_group(proc.pid)
        out, err = await proc.communicate()
        return HarnessRun(
            None,
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            time.monotonic() - started,
            f"{harness.name} timed out after {timeout:g} s (killed)",
        )
    finally:
        kill_group(proc.pid)  # whatever it left running in the background
        kill_leftovers(Path(env["HOME"]))  # and in sessions of their own
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    error = None
    if proc.returncode != 0:
        last = (stderr.strip() or stdout.strip()).splitlines()[-1:] or [""]
        error = f"{harness.name} exited {proc.returncode}: {last[0][:300]}"
    return HarnessRun(proc.returncode, stdout, stderr, time.monotonic() - started, error)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_leftovers(home: Path) -> list[int]:
    """Kill every process still running with the rollout's HOME (the pids killed). A harness may
    leave a daemon in a session of its own, out of its process group's reach: Cline's
    `--cline-hub-daemon` outlives every run. Linux's /proc; nothing elsewhere."""
    mark = b"\0HOME=" + str(home).encode() + b"\0"
    killed = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            if pid != os.getpid() and mark in b"\0" + environ.read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except OSError:
            continue
    return killed
