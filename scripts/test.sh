#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test and readers extras and offline tokenizer
# assets) and the pinned npm harnesses the tests/e2e/ tests run (scripts/install_harnesses.sh;
# failing to install them fails here, it is never a skip), then runs pytest.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test,readers
export PATH="$PWD/.venv/bin:$PATH"
./scripts/install_harnesses.sh >/dev/null || { echo "error: the pinned harnesses could not be installed (scripts/install_harnesses.sh)" >&2; exit 1; }
exec .venv/bin/python -m pytest "$@"
