#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test extras and offline tokenizer assets), then runs pytest.
# The real-model tests also need llama-cpp-python (built once into .cache/wheels) and the trainer
# venv .venv-trainer (Python 3.11 + torch CPU); both are set up here unless POLAR_REALMODEL=0.
# Without them those tests skip, except under CI (CI set), where they fail. Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test
if [ "${POLAR_REALMODEL:-1}" != "0" ]; then
    # a failure here does not stop the rest of the suite: those tests skip (and fail under CI)
    polar_realmodel .venv || echo "warning: the realmodel extra is not installed; its tests will skip" >&2
    polar_trainer_venv .venv-trainer || echo "warning: no trainer venv; the trainer-check tests will skip" >&2
fi
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
