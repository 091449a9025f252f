#!/usr/bin/env bash
# Installs the coding-agent harnesses the e2e tests run (Codex CLI, Claude Code, Pi, Gemini CLI), unmodified,
# at the versions pinned in tests/e2e/npm/package.json + package-lock.json (the one place they are
# pinned), into a cache dir that survives fresh clones: $POLAR_HARNESS_DIR, default
# ~/.cache/polar-mitm/npm-harnesses. Reinstalls only when the lock file changed (a stamp holds its
# hash). Prints the dir's node_modules/.bin on success; exits non-zero, saying why, otherwise:
# CI runs it and must fail, not skip, when the harnesses cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=tests/e2e/npm
DIR="${POLAR_HARNESS_DIR:-$HOME/.cache/polar-mitm/npm-harnesses}"
command -v npm >/dev/null || { echo "error: npm is not installed (apt-get install nodejs npm)" >&2; exit 1; }
want="$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -c1-16)"
if [ "$(cat "$DIR/.polar-stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing the harnesses pinned in $SRC into $DIR" >&2
    mkdir -p "$DIR"
    cp "$SRC/package.json" "$SRC/package-lock.json" "$DIR/"
    log="$(mktemp)"
    # Claude Code's postinstall copies its native binary over a stub: install scripts must run.
    if ! (cd "$DIR" && npm ci --no-audit --no-fund --loglevel=error --engine-strict=false) >"$log" 2>&1; then
        cat "$log" >&2; rm -f "$log"
        echo "error: npm ci of the pinned harnesses failed (see above)" >&2
        exit 1
    fi
    rm -f "$log"
    echo "$want" > "$DIR/.polar-stamp"
fi
BIN="$DIR/node_modules/.bin"
# Each binary must run and report the pinned version (a stub or a partial install fails here).
check() {  # check BIN EXPECTED
    local got
    got="$("$BIN/$1" --version 2>&1 | head -1)" || { echo "error: $BIN/$1 --version failed: $got" >&2; rm -f "$DIR/.polar-stamp"; exit 1; }
    case "$got" in *"$2"*) ;; *) echo "error: $1 reports '$got', want $2" >&2; rm -f "$DIR/.polar-stamp"; exit 1 ;; esac
}
pin() {
    local v
    v="$(sed -n "s|.*\"$1\": \"\([^\"]*\)\".*|\1|p" "$SRC/package.json")"
    [ -n "$v" ] || { echo "error: no pinned version of $1 in $SRC/package.json" >&2; exit 1; }
    echo "$v"
}
codex_v="$(pin @openai/codex)"
claude_v="$(pin @anthropic-ai/claude-code)"
pi_v="$(pin @mariozechner/pi-coding-agent)"
gemini_v="$(pin @google/gemini-cli)"
check codex "$codex_v"
check claude "$claude_v"
check pi "$pi_v"
check gemini "$gemini_v"
echo "$BIN"
