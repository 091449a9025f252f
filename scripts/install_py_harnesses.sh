#!/usr/bin/env bash
# Installs the PyPI harnesses the e2e tests run (mini-SWE-agent, OpenHands SDK, Hermes Agent,
# Aider), unmodified, at the versions pinned in tests/e2e/pypi/pins.txt, each into a venv of its own (their
# dependencies clash) under a cache dir that survives fresh clones: $POLAR_PY_HARNESS_DIR, default
# ~/.cache/polar-mitm/py-harnesses/<name>. A venv is rebuilt only when its pin changed (a stamp).
# Arguments: the names to install (default: all). Prints the cache dir on success; exits non-zero,
# saying which failed and why, otherwise (CI must fail, not skip).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
DIR="${POLAR_PY_HARNESS_DIR:-$HOME/.cache/polar-mitm/py-harnesses}"
py="$(polar_find_python)"
mkdir -p "$DIR"
fail=0
while read -r name binary requirements; do
    case "$name" in ''|'#'*) continue ;; esac
    [ $# -eq 0 ] || [[ " $* " == *" $name "* ]] || continue
    venv="$DIR/$name"
    if [ "$(cat "$venv/.polar-stamp" 2>/dev/null)" != "$requirements" ]; then
        echo "installing $requirements into $venv" >&2
        rm -rf "$venv"
        log="$(mktemp)"
        if "$py" -m venv "$venv" >"$log" 2>&1 \
            && "$venv/bin/python" -m pip install -q --disable-pip-version-check $requirements >>"$log" 2>&1; then
            echo "$requirements" >"$venv/.polar-stamp"
        else
            cat "$log" >&2
            echo "error: $requirements could not be installed into $venv (see above)" >&2
            fail=1
        fi
        rm -f "$log"
    fi
    [ -x "$venv/bin/$binary" ] || { echo "error: $venv/bin/$binary is missing" >&2; rm -f "$venv/.polar-stamp"; fail=1; }
done < tests/e2e/pypi/pins.txt
[ "$fail" = 0 ] || exit 1
echo "$DIR"
