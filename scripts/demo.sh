#!/usr/bin/env bash
# The whole capture path on this machine, no GPU: the reference policy server (vLLM wire format,
# real Qwen3 tokenizer), mitmdump with the addon, a real multi-turn tool-calling session through
# HTTPS_PROXY with the generated CA, then the summary of what was captured.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_venv .venv test
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

echo "== starting the reference policy server (vLLM wire format, Qwen3 tokenizer)"
polar-mitm policy-server --port 0 >"$LOGS/policy.log" 2>&1 &
PIDS+=($!)
wait_for "$LOGS/policy.log" "listening on" 120
UPSTREAM="$(grep -o 'http://[0-9.:]*' "$LOGS/policy.log" | head -1)"

PORT="$(free_port)"
echo "== starting mitmdump -s addons/polar.py on 127.0.0.1:$PORT -> $UPSTREAM"
mitmdump -s addons/polar.py --listen-host 127.0.0.1 --listen-port "$PORT" \
    --set confdir=certs --set polar_upstream="$UPSTREAM" --set polar_output="$OUT/data" \
    >"$LOGS/mitmdump.log" 2>&1 &
MITM=$!
PIDS+=($MITM)
wait_for "$LOGS/mitmdump.log" "polar-mitm: capturing" 60

echo "== harness environment (polar-mitm env --proxy http://127.0.0.1:$PORT --rollout demo-task.0)"
ENV_LINES="$(polar-mitm env --proxy "http://127.0.0.1:$PORT" --rollout demo-task.0)"
echo "$ENV_LINES" | sed 's/^/   /'
echo "== running an openai-SDK tool-calling session against https://api.openai.com/v1"
(
    eval "$ENV_LINES"
    export OPENAI_API_KEY="polar-demo-task.0"
    python scripts/demo_session.py
)

kill -INT "$MITM"; wait "$MITM" || true
echo "== captured under $OUT/data"
polar-mitm summary "$OUT/data"
