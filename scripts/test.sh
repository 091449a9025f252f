#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test and readers extras and offline tokenizer assets),
# then runs pytest.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test,readers
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
