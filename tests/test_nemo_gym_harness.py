"""The NeMo Gym agent's harness table (polar_mitm/nemo_gym/harness.py), without Gym or npm: each
`harness:` value's config files, command line and environment, run through the agent's own
`run_harness` with a stand-in binary that reports what it got. The real binaries with these very
entries are run by tests/e2e/ (test_harnesses.py builds its harnesses from this table)."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.nemo_gym import harness as agent

PROXY = "http://10.0.0.5:8080"
ROLLOUT = "fix-add.3"


def stand_in(bin_dir: Path, name: str) -> None:
    """A `name` in bin_dir that writes its argv, environment and HOME's files to report.json."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, pathlib, sys\n"
        "home = pathlib.Path(os.environ['HOME'])\n"
        "files = {str(p.relative_to(home)): p.read_text() for p in home.rglob('*') if p.is_file()}\n"
        "pathlib.Path('report.json').write_text(json.dumps("
        "{'argv': sys.argv[1:], 'env': dict(os.environ), 'files': files}))\n"
        "print('done')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture(autouse=True)
def py_harness_dir(monkeypatch, tmp_path):
    """The PyPI harnesses' venvs (stand-ins too) under tmp_path, not the real cache."""
    monkeypatch.setattr(agent, "DEFAULT_PY_DIR", tmp_path / "py-harnesses")


def run(tmp_path: Path, name: str, bin_dir: Path | None = None) -> dict:
    h = agent.HARNESSES[name]
    bin_dir = bin_dir or tmp_path / "node_modules" / ".bin"
    stand_in(h.executable(bin_dir).parent, h.binary)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = agent.harness_env(h, home, PROXY, tmp_path / "ca.pem", ROLLOUT, bin_dir)
    ran = asyncio.run(agent.run_harness(h, bin_dir, agent.DEFAULT_MODEL, "the task", work, env, 30))
    assert (ran.returncode, ran.error, ran.stdout) == (0, None, "done\n"), ran.stderr
    return json.loads((work / "report.json").read_text())


@pytest.mark.parametrize("name", sorted(agent.HARNESSES))
def test_every_harness_gets_the_rollout_environment_and_no_other(tmp_path, name):
    got = run(tmp_path, name)
    env = got["env"]
    bin_dir = tmp_path / "node_modules" / ".bin"
    # the install's bin dir (where Node 22 is linked when the machine's is older) comes first;
    # OpenClaw's is its own install's, beside it (its Node 24; tested below)
    want = bin_dir if name != "openclaw" else agent.HARNESSES[name].bin_dir(bin_dir)
    assert env["PATH"].split(":")[0] == str(want)
    assert env[agent.HARNESSES[name].key_variable] == f"polar-{ROLLOUT}"
    assert env["HTTPS_PROXY"] == f"http://{ROLLOUT}:polar@10.0.0.5:8080"
    assert env["NO_PROXY"] == "localhost,127.0.0.1,::1"  # OpenCode's own local server
    assert env["NODE_EXTRA_CA_CERTS"] == str(tmp_path / "ca.pem")
    allowed = {"HOME", "PATH", "TERM", agent.HARNESSES[name].key_variable}
    allowed |= set(agent.HARNESSES[name].extra_env)
    allowed |= {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "NO_PROXY", "no_proxy"}
    allowed |= {
        "NODE_EXTRA_CA_CERTS",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CODEX_CA_CERTIFICATE",
    }
    # nothing of this process's environment leaks in (a Gym server's holds its whole config)
    assert set(env) - {"PWD", "SHLVL", "_", "LC_CTYPE"} <= allowed, set(env) - allowed
    assert got["argv"][-1] == "the task"


def test_pi_1x_reads_the_key_from_the_environment(tmp_path):
    got = run(tmp_path, "pi")
    models = json.loads(got["files"][".pi/agent/models.json"])
    provider = models["providers"]["polar"]
    assert provider["apiKey"] == "$OPENAI_API_KEY"  # Pi 1.x: a bare name is a literal key
    assert provider["baseUrl"] == "https://api.openai.com/v1"
    assert provider["models"] == [{"id": agent.DEFAULT_MODEL}]
    assert got["argv"] == ["--provider", "polar", "--model", agent.DEFAULT_MODEL, "-p", "the task"]


def test_the_previous_pi_names_the_variable(tmp_path):
    """The previous pins' Pi (@mariozechner 0.x) reads a bare name as a variable, `$NAME` as a
    literal: the install it runs from decides."""
    package = tmp_path / "node_modules" / "@mariozechner" / "pi-coding-agent"
    stand_in(package, "cli.js")
    bin_dir = tmp_path / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "pi").symlink_to(package / "cli.js")
    assert agent.pi_api_key(bin_dir) == "OPENAI_API_KEY"
    assert agent.pi_api_key(tmp_path / "elsewhere") == "$OPENAI_API_KEY"


def test_qwen_code_goes_to_the_real_host_without_telemetry(tmp_path):
    got = run(tmp_path, "qwen")
    assert got["env"]["OPENAI_BASE_URL"] == "https://api.openai.com/v1"
    assert got["argv"] == [
        "--yolo",
        "--auth-type",
        "openai",
        "--model",
        agent.DEFAULT_MODEL,
        "the task",
    ]
    settings = json.loads(got["files"][".qwen/settings.json"])
    assert settings["privacy"]["usageStatisticsEnabled"] is False


def test_opencode_has_one_openai_compatible_provider(tmp_path):
    got = run(tmp_path, "opencode")
    config = json.loads(got["files"][".config/opencode/opencode.json"])
    provider = config["provider"]["polar"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {
        "baseURL": "https://api.openai.com/v1",
        "apiKey": "{env:OPENAI_API_KEY}",
    }
    assert config["model"] == f"polar/{agent.DEFAULT_MODEL}"
    assert list(provider["models"]) == [agent.DEFAULT_MODEL]
    assert got["argv"] == ["run", "the task"]
    assert got["env"]["OPENCODE_DISABLE_MODELS_FETCH"] == "1"


def test_openclaw_has_one_stateless_responses_provider_and_its_own_node(tmp_path):
    """OpenClaw: a custom provider on the Responses API at the real host (OpenClaw's built-in
    `openai` provider sends `previous_response_id`, which the proxy refuses), its key from
    OPENAI_API_KEY, the default model; its binary and Node 24 in the install beside the others'
    ("<dir>-openclaw", scripts/install_harnesses.sh)."""
    bin_dir = tmp_path / "h" / "node_modules" / ".bin"
    h = agent.HARNESSES["openclaw"]
    assert h.bin_dir(bin_dir) == tmp_path / "h-openclaw" / "node_modules" / ".bin"
    assert h.executable(bin_dir) == h.bin_dir(bin_dir) / "openclaw"
    got = run(tmp_path, "openclaw", bin_dir)
    config = json.loads(got["files"][".openclaw/openclaw.json"])
    provider = config["models"]["providers"]["polar"]
    assert provider["baseUrl"] == "https://api.openai.com/v1"
    assert provider["api"] == "openai-responses"
    assert provider["apiKey"] == "${OPENAI_API_KEY}"
    assert [m["id"] for m in provider["models"]] == [agent.DEFAULT_MODEL]
    assert config["agents"]["defaults"]["model"]["primary"] == f"polar/{agent.DEFAULT_MODEL}"
    assert got["argv"] == ["agent", "exec", "the task"]
    assert got["env"]["PATH"].split(":")[0] == str(h.bin_dir(bin_dir))


def test_the_default_bin_dir_follows_the_install_script(monkeypatch, tmp_path):
    """POLAR_HARNESS_DIR and POLAR_HARNESS_PINS=previous, as scripts/install_harnesses.sh reads them."""
    import importlib

    monkeypatch.setenv("POLAR_HARNESS_DIR", str(tmp_path / "h"))
    monkeypatch.delenv("POLAR_HARNESS_PINS", raising=False)
    assert tmp_path / "h" / "node_modules" / ".bin" == importlib.reload(agent).DEFAULT_BIN_DIR
    monkeypatch.setenv("POLAR_HARNESS_PINS", "previous")
    reloaded = importlib.reload(agent).DEFAULT_BIN_DIR
    assert reloaded == tmp_path / "h-previous" / "node_modules" / ".bin"
    monkeypatch.undo()  # this process's own variables back, and the module as they make it
    importlib.reload(agent)


def test_a_daemon_left_in_a_session_of_its_own_is_killed(tmp_path):
    """A harness that leaves a process in a new session (as Cline's hub daemon does) out of its
    process group's reach: `run_harness` still kills it (it runs with the rollout's HOME)."""
    h = agent.HARNESSES["cline"]
    bin_dir = tmp_path / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / h.binary
    script.write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys\n"
        "d = subprocess.Popen(['sleep', '300'], start_new_session=True, stdin=-3, stdout=-3,"
        " stderr=-3)\n"  # a daemon: its own session, its stdio closed (subprocess.DEVNULL)
        "open('daemon.pid', 'w').write(str(d.pid))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = agent.harness_env(h, home, PROXY, tmp_path / "ca.pem", ROLLOUT, bin_dir)
    ran = asyncio.run(agent.run_harness(h, bin_dir, agent.DEFAULT_MODEL, "the task", work, env, 30))
    assert ran.returncode == 0, ran.stderr
    pid = int((work / "daemon.pid").read_text())
    for _ in range(50):  # SIGKILL is sent; the zombie is reaped by init
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the daemon {pid} outlived the run")
