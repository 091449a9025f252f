"""The README's quick start, run literally from a wheel installed outside the checkout (issue 46).

What a new user does: build (or download) the wheel, `pip install` it into a clean venv, and type
the README's "Use it" lines in a folder of their own. The lines are read from README.md itself,
so the README cannot drift from what works. Two addresses are the test's own, replaced before
the run and nothing else: the policy server the README calls `http://127.0.0.1:8000` is the
reference server here (on a free port), and the proxy's port 8080 is a free port. The clean venv
has no polar-mitm source on its path: the addon, the CA folder and the CLI must all come from
the install. Its config folder (where the CA goes by default) is the test's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers.procs import free_port
from tests.helpers.time_limits import shared_setup_limit

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
README_UPSTREAM = "http://127.0.0.1:8000"
README_PROXY = "127.0.0.1:8080"
README_PORT = "--listen-port 8080"


def quickstart(readme: str) -> str:
    """The shell lines of the README's "Use it" section: its ```bash blocks, in order."""
    section = readme.split("\n## Use it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "README.md's 'Use it' section has no bash block"
    return "\n".join(blocks)


def test_quickstart_is_in_the_readme():
    """The extraction itself: the lines the install test runs are the README's three steps."""
    lines = quickstart((ROOT / "README.md").read_text())
    for needle in (
        "polar-mitm proxy --upstream " + README_UPSTREAM,
        f"polar-mitm env --proxy http://{README_PROXY}",
        "polar-mitm end ",
        "polar-mitm export ./polar-data --format verl",
        "polar-mitm export ./polar-data --format slime",
    ):
        assert needle in lines, needle
    # the site's quick start shows the same lines (it explains them; it must not drift either)
    page = (ROOT / "docs" / "quickstart.md").read_text()
    for line in lines.splitlines():
        assert line in page, line


@pytest.fixture(scope="module")
@shared_setup_limit(900)
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv outside the checkout with the wheel built from it (pip's cache serves the
    dependencies; CI's set-up warms it)."""
    tmp = tmp_path_factory.mktemp("install")
    assert not tmp.is_relative_to(ROOT)
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(ROOT)], check=True)
    [wheel] = (tmp / "dist").glob("polar_mitm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "polar_mitm/addons/script/addon.py" in names  # the addon ships in the wheel
    built = time.monotonic()
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([venv / "bin/python", *pip[1:], "install", str(wheel)], check=True)
    print(
        f"wheel built in {built - started:.0f} s, venv installed in {time.monotonic() - built:.0f} s"
    )
    return venv


def test_readme_quickstart_from_the_wheel(installed: Path, make_policy_server, tmp_path: Path):
    server = make_policy_server()
    port = free_port()
    script = quickstart((ROOT / "README.md").read_text())
    for readme, ours in (
        (README_UPSTREAM, server.url),
        (README_PROXY, f"127.0.0.1:{port}"),
        (README_PORT, f"--listen-port {port}"),
    ):
        assert readme in script, readme
        script = script.replace(readme, ours)
    work = tmp_path / "user"
    work.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("POLAR_", "PYTHON", "VIRTUAL_ENV", "HTTP", "HTTPS", "http", "https"))
    }
    env.update(PATH=f"{installed / 'bin'}:{env['PATH']}", XDG_CONFIG_HOME=str(tmp_path / "config"))
    # its own session, so that a proxy it leaves in the background (a failed step) is stopped
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    # the installed package, never the checkout
    where = subprocess.run(
        [installed / "bin/polar-mitm", "addon"], cwd=work, env=env, capture_output=True, text=True
    )
    assert where.stdout.startswith(str(installed)), where.stdout
    # the CA the proxy signed with is the user's config folder's, the one `env` named
    assert (tmp_path / "config/polar-mitm/mitmproxy-ca-cert.pem").is_file()
    assert "wrote 1 verl record(s) of 1 rollout(s)" in proc.stdout, proc.stdout
    assert "wrote 1 slime record(s) of 1 rollout(s)" in proc.stdout, proc.stdout
    [sample] = [json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()]
    assert sample["reward"] == 1.0
    assert sum(sample["loss_mask"]) > 0 and len(sample["tokens"]) > sample["response_length"] > 0
    import numpy as np

    batch = np.load(work / "rollouts.npz", allow_pickle=False)
    assert batch["responses"].shape[0] == 1 and batch["response_mask"].sum() > 0
