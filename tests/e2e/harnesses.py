"""The real harnesses, as the e2e tests and the wire recorder run them.

Each is the unmodified npm package pinned in tests/e2e/npm/ (installed by
scripts/install_harnesses.sh; `POLAR_HARNESS_PINS=previous` selects the previous release's pins in
tests/e2e/npm/previous/, which hold fewer harnesses), run non-interactively in a temp workdir with
a temp HOME and an environment made of nothing but `polar-mitm env` output, PATH/HOME, and an API
key `polar-<rollout id>` — what a rollout container would get. PATH starts with the install's
node_modules/.bin, which holds the Node.js the harnesses need when the machine's is older
(OpenClaw's: its own install's, with its Node 24, tests/e2e/npm/openclaw/).
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

from polar_mitm.nemo_gym import harness as agent_harness

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install_harnesses.sh"
INSTALL_LOCK = (
    Path.home() / ".cache" / "polar-mitm" / ".harness-install.lock"
)  # scripts/test.sh's too
PY_INSTALL = ROOT / "scripts" / "install_py_harnesses.sh"
PY_INSTALL_LOCK = INSTALL_LOCK.with_name(".py-harness-install.lock")  # scripts/test.sh's too
PIN_SETS = {"current": "", "previous": "previous"}
PIN_SET = os.environ.get("POLAR_HARNESS_PINS") or "current"
if PIN_SET not in PIN_SETS:
    raise ValueError(f"POLAR_HARNESS_PINS={PIN_SET!r}: want one of {', '.join(PIN_SETS)}")
PIN_FILE = ROOT / "tests" / "e2e" / "npm" / PIN_SETS[PIN_SET] / "package.json"
PINS = json.loads(PIN_FILE.read_text())["dependencies"]
# The PyPI harnesses (scripts/install_py_harnesses.sh; one pin set: the previous pins hold none)
PY_PIN_FILE = ROOT / "tests" / "e2e" / "pypi" / "pins.txt"
if PIN_SET == "current":
    for _line in PY_PIN_FILE.read_text().splitlines():
        if _line.strip() and not _line.startswith("#"):
            _package, _, _version = _line.split()[2].partition("==")
            PINS[_package] = _version
# OpenClaw, on its own Node 24 (tests/e2e/npm/openclaw/; none in the previous pins)
OPENCLAW_PIN_FILE = ROOT / "tests" / "e2e" / "npm" / "openclaw" / "package.json"
if PIN_SET == "current":
    PINS.update(json.loads(OPENCLAW_PIN_FILE.read_text())["dependencies"])
# Pi moved scope at 1.0: the deprecated one is the previous pins'.
PI_PACKAGE = next(
    (p for p in ("@earendil-works/pi-coding-agent", "@mariozechner/pi-coding-agent") if p in PINS),
    "@earendil-works/pi-coding-agent",
)

PROMPT = "Create a file named hello.txt containing exactly the text: polar was here"
FILE_NAME, FILE_TEXT = "hello.txt", "polar was here"
SHELL_COMMAND = f"printf '{FILE_TEXT}' > {FILE_NAME} && cat {FILE_NAME}"
FINAL_TEXT = "I created hello.txt; it says: polar was here"

# The model name each harness asks for (set in its config where it has one).
MODEL = agent_harness.DEFAULT_MODEL


class InstallError(RuntimeError):
    pass


def install() -> Path:
    """Run the install scripts (idempotent: a stamp check when nothing changed); the npm bin dir
    (the PyPI harnesses' venvs are where `agent_harness.DEFAULT_PY_DIR` says). One install at a
    time per machine and per script (pytest-xdist workers, scripts/test.sh): the locks."""
    scripts = [(INSTALL, INSTALL_LOCK)]
    if PIN_SET == "current":
        scripts.append((PY_INSTALL, PY_INSTALL_LOCK))
    out = ""
    for script, lock_file in scripts:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            r = subprocess.run([str(script)], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise InstallError(
                f"{script.name} failed (rc={r.returncode}): the pinned harnesses could not be "
                f"installed:\n{r.stderr[-4000:]}"
            )
        out = out or r.stdout
    return Path(out.strip().splitlines()[-1])


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
    dialect: str  # the wire recorder's name of its LLM API: chat | responses | messages | gemini
    argv: Callable[[Path, str], list[str]]  # (bin dir, prompt) -> argv
    configure: Callable[[Path, Path, Path], None] = lambda home, work, bin_dir: None
    extra_env: dict[str, str] = field(default_factory=dict)
    # the bin dir first on its PATH (OpenClaw's install of its own, with Node 24)
    path_dir: Callable[[Path], Path] = lambda bin_dir: bin_dir

    @property
    def version(self) -> str:
        return PINS[self.package]


def _as_the_agent_runs_it(name: str, package: str, dialect: str) -> Harness:
    """The harness exactly as the NeMo Gym agent runs it (polar_mitm/nemo_gym/harness.py: the
    configuration the README shows), asking for MODEL."""
    spec = agent_harness.HARNESSES[name]
    return Harness(
        name=name,
        package=package,
        binary=spec.binary,
        key_variable=spec.key_variable,
        dialect=dialect,
        argv=lambda bin_dir, prompt: spec.argv(bin_dir, MODEL, prompt),
        configure=lambda home, work, bin_dir: spec.configure(home, MODEL, bin_dir),
        extra_env=dict(spec.extra_env),
        path_dir=spec.bin_dir,
    )


_ALL = (
    _as_the_agent_runs_it("pi", PI_PACKAGE, "chat"),
    _as_the_agent_runs_it("codex", "@openai/codex", "responses"),
    _as_the_agent_runs_it("claude", "@anthropic-ai/claude-code", "messages"),
    _as_the_agent_runs_it("qwen", "@qwen-code/qwen-code", "chat"),
    _as_the_agent_runs_it("opencode", "opencode-ai", "chat"),
    _as_the_agent_runs_it("gemini", "@google/gemini-cli", "gemini"),
    _as_the_agent_runs_it("mini-swe-agent", "mini-swe-agent", "chat"),
    _as_the_agent_runs_it("openhands", "openhands-sdk", "responses"),
    _as_the_agent_runs_it("hermes", "hermes-agent", "responses"),
    _as_the_agent_runs_it("cline", "cline", "chat"),
    _as_the_agent_runs_it("kilo", "@kilocode/cli", "chat"),
    _as_the_agent_runs_it("aider", "aider-chat", "chat"),
    _as_the_agent_runs_it("openclaw", "openclaw", "responses"),
)
# The harnesses the selected pins hold (the previous release's pins have no Qwen Code, OpenCode
# or Gemini CLI).
HARNESSES: dict[str, Harness] = {h.name: h for h in _ALL if h.package in PINS}


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
    harness.configure(home, work, bin_dir)
    env = {
        "HOME": str(home),
        "PATH": f"{harness.path_dir(bin_dir)}:{agent_harness.SYSTEM_PATH}",
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
        agent_harness.kill_leftovers(home)
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return HarnessResult(
            124, out, err + f"\n[timed out after {timeout} s]", timeout, work, home
        )
    agent_harness.kill_leftovers(home)  # daemons it left (Cline's hub), as the agent does
    return HarnessResult(r.returncode, r.stdout, r.stderr, time.monotonic() - started, work, home)


def clean_env() -> dict[str, str]:
    """This process's environment without proxy or CA variables (for helper processes)."""
    drop = {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"}
    return {k: v for k, v in os.environ.items() if k not in drop}
