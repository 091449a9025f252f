"""The three real harnesses, as the e2e tests and the wire recorder run them.

Each is the unmodified npm package pinned in tests/e2e/npm/ (installed by
scripts/install_harnesses.sh), run non-interactively in a temp workdir with a temp HOME and an
environment made of nothing but `polar-mitm env` output, PATH/HOME, and an API key
`polar-<rollout id>` — what a rollout container would get.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install_harnesses.sh"
INSTALL_LOCK = (
    Path.home() / ".cache" / "polar-mitm" / ".harness-install.lock"
)  # scripts/test.sh's too
PINS = json.loads((ROOT / "tests" / "e2e" / "npm" / "package.json").read_text())["dependencies"]

PROMPT = "Create a file named hello.txt containing exactly the text: polar was here"
FILE_NAME, FILE_TEXT = "hello.txt", "polar was here"
SHELL_COMMAND = f"printf '{FILE_TEXT}' > {FILE_NAME} && cat {FILE_NAME}"
FINAL_TEXT = "I created hello.txt; it says: polar was here"

# The model name each harness asks for (set in its config where it has one).
PI_MODEL = "gpt-4.1-mini"


class InstallError(RuntimeError):
    pass


def install() -> Path:
    """Run the install script (idempotent: a stamp check when nothing changed); the bin dir.
    One install at a time per machine (pytest-xdist workers, scripts/test.sh): INSTALL_LOCK."""
    INSTALL_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise InstallError(
            f"{INSTALL.name} failed (rc={r.returncode}): the pinned harnesses could not be "
            f"installed:\n{r.stderr[-4000:]}"
        )
    return Path(r.stdout.strip().splitlines()[-1])


def parse_env(lines: str) -> dict[str, str]:
    """`export NAME=VALUE` lines (shell-quoted, as `polar-mitm env` prints them) as a dict."""
    env: dict[str, str] = {}
    for line in lines.splitlines():
        if not line.startswith("export "):
            continue
        name, _, value = line[len("export ") :].partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    return env


@dataclass(frozen=True)
class Harness:
    name: str
    package: str
    binary: str
    key_variable: str
    dialect: str  # what the wire recorder calls its LLM endpoint: chat | responses | messages
    argv: Callable[[Path, str], list[str]]
    configure: Callable[[Path, Path], None] = lambda home, work: None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return PINS[self.package]


def _pi_configure(home: Path, work: Path) -> None:
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": "https://api.openai.com/v1",
        "api": "openai-completions",
        "apiKey": "OPENAI_API_KEY",  # the name of the env var that holds the key
        "models": [{"id": PI_MODEL}],
    }
    (agent / "models.json").write_text(json.dumps({"providers": {"polar": provider}}, indent=2))


HARNESSES: dict[str, Harness] = {
    "pi": Harness(
        name="pi",
        package="@mariozechner/pi-coding-agent",
        binary="pi",
        key_variable="OPENAI_API_KEY",
        dialect="chat",
        argv=lambda bin_dir, prompt: [
            str(bin_dir / "pi"),
            "--provider",
            "polar",
            "--model",
            PI_MODEL,
            "-p",
            prompt,
        ],
        configure=_pi_configure,
    ),
    "codex": Harness(
        name="codex",
        package="@openai/codex",
        binary="codex",
        key_variable="OPENAI_API_KEY",
        dialect="responses",
        argv=lambda bin_dir, prompt: [
            str(bin_dir / "codex"),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            prompt,
        ],
    ),
    "claude": Harness(
        name="claude",
        package="@anthropic-ai/claude-code",
        binary="claude",
        key_variable="ANTHROPIC_API_KEY",
        dialect="messages",
        argv=lambda bin_dir, prompt: [
            str(bin_dir / "claude"),
            "-p",
            "--dangerously-skip-permissions",
            prompt,
        ],
        # As root, --dangerously-skip-permissions is refused unless the harness is told it is
        # in a sandbox.
        extra_env={"IS_SANDBOX": "1"},
    ),
}


@dataclass
class HarnessResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    workdir: Path
    home: Path


def run_harness(
    harness: Harness,
    bin_dir: Path,
    base: Path,
    env_lines: str,
    api_key: str,
    wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
    prompt: str = PROMPT,
    timeout: float = 180.0,
) -> HarnessResult:
    """Run one harness to completion under `base` (its HOME and workdir are made there).

    `env_lines` is `polar-mitm env` output; the harness gets that, HOME, PATH, TERM and its API
    key, nothing else from this process. `wrap` puts the command in a network namespace."""
    home, work = base / f"{harness.name}-home", base / f"{harness.name}-work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    harness.configure(home, work)
    env = {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "TERM": "dumb",
        **parse_env(env_lines),
        harness.key_variable: api_key,
        **harness.extra_env,
    }
    started = time.monotonic()
    try:
        r = subprocess.run(
            wrap(harness.argv(bin_dir, prompt)),
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,  # codex exec waits for more input on an open stdin
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return HarnessResult(
            124, out, err + f"\n[timed out after {timeout} s]", timeout, work, home
        )
    return HarnessResult(r.returncode, r.stdout, r.stderr, time.monotonic() - started, work, home)


def clean_env() -> dict[str, str]:
    """This process's environment without proxy or CA variables (for helper processes)."""
    drop = {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"}
    return {k: v for k, v in os.environ.items() if k not in drop}
