#!/usr/bin/env bash
# The GPU check, one script for a lent GPU machine that reaches no package index (README "## GPU"):
#   1 setup   the device's own Python (>= 3.12) plus the wheels carried in $LUMINAL_WHEELHOUSE (default
#             .whl, made here by `python scripts/gpu_carry.py pack`), unpacked into a folder put first on
#             PYTHONPATH; reports NVRTC and its headers, the carry's size, and that `pytest -m gpu` collects
#   2 device  prints the CUDA device (the project's own probe); stops here without one
#   3 pytest  `pytest -m gpu` (every GPU test: kernels, Gemm layouts and variants, graphs, MiniLM shapes)
#   4 e2e     test transformer + random-weight MiniLM, FP32/TF32/BF16/FP8 plans, CUDA vs the CPU backend
#   5 graph   CUDA-graph replay equal to the eager run bit for bit
#   6 timing  CUDA-event timing of MiniLM FP32 vs BF16 vs FP8 -> reports/bench/gpu_latency.csv
#   7 kernels per-kernel measured vs modelled (MiniLM, SmolLM2-shaped decode per genome) -> gpu_kernels.csv
#   8 megakernel  the megakernel on the device vs the CPU backend, measured vs modelled -> gpu_megakernel.csv
#   9 fp8acc  FP8 cuBLASLt inputs and outputs saved for the offline accumulation model -> fp8acc.npz
# Exit codes: 0 all passed, 2 setup failed, 3 no CUDA device, 4..10 the first failed stage of 3..9.
# LUMINAL_GPU_STAGES="kernels megakernel" runs only the named device stages (default: all).
# Logs: $OUT/gpu_check/<stage>.log when OUT is set (else reports/gpu_check/), plus summary.txt (a table).
# Python: $LUMINAL_GPU_PYTHON if set, else python3. Nothing is ever fetched: what the Python lacks must
# be in the wheelhouse. LUMINAL_GPU_CHECK_NO_DEVICE=1 takes the no-device path (the dry run's test).
# Budget: under 8 minutes; each stage has its own timeout (seconds below).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
LOG_DIR="${OUT:+$OUT/gpu_check}"
LOG_DIR="${LOG_DIR:-$ROOT/reports/gpu_check}"
WHEELHOUSE="${LUMINAL_WHEELHOUSE:-$ROOT/.whl}"
SITE="${LUMINAL_GPU_SITE:-${TMPDIR:-/tmp}/luminal_gpu_site}"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1  # nothing below installs from an index; a stray pip must not try either
mkdir -p "$LOG_DIR"
SUMMARY="$LOG_DIR/summary.txt"
printf '%-7s %-5s %6s  %s\n' stage result time detail > "$SUMMARY"
T_SETUP=60 T_PYTEST=200 T_E2E=110 T_GRAPH=60 T_TIMING=60 T_KERNELS=150 T_MEGAKERNEL=120 T_FP8ACC=60

row() { printf '%-7s %-5s %5ss  %s\n' "$1" "$2" "$3" "$4" >> "$SUMMARY"; }
finish() {
    row total "$([ "$1" -eq 0 ] && echo ok || echo FAIL)" "$SECONDS" "exit $1 ($2); logs in $LOG_DIR"
    cat "$SUMMARY"
    exit "$1"
}

# -- 1 setup ----------------------------------------------------------------------------------------
find_python() {
    if [ -n "${LUMINAL_GPU_PYTHON:-}" ]; then echo "$LUMINAL_GPU_PYTHON"; return 0; fi
    for cand in python3 python3.12 python3.13; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    return 1
}
setup() {
    PY="$(find_python)" || { echo "no Python >= 3.12 found (set LUMINAL_GPU_PYTHON)"; return 1; }
    "$PY" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null || { echo "$PY is not a Python >= 3.12"; return 1; }
    echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    if [ -d "$WHEELHOUSE" ]; then
        timeout "$T_SETUP" "$PY" scripts/gpu_carry.py install "$WHEELHOUSE" "$SITE" || return 1
    fi
    if ! "$PY" scripts/gpu_carry.py missing; then
        echo "setup: this Python lacks the packages above and $WHEELHOUSE holds no wheel of them: run" \
             "\`python scripts/gpu_carry.py pack\` where they are installed, and carry .whl"
        return 1
    fi
    if command -v git >/dev/null 2>&1 && [ -d "$WHEELHOUSE" ] && git -C "$ROOT" rev-parse >/dev/null 2>&1; then
        "$PY" scripts/gpu_carry.py report --dest "$WHEELHOUSE" || echo "carry: over the limit"
    fi
    "$PY" -c 'from luminal_num.codegen import nvrtc
try:
    t = nvrtc.toolchain()
    print(f"nvrtc: {t.library} {t.version[0]}.{t.version[1]}, headers {[str(d) for d in t.include_dirs] or None}")
except nvrtc.NvrtcUnavailableError as error:
    print(f"nvrtc: none ({error})")' || return 1
    timeout "$T_SETUP" "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests > "$LOG_DIR/collect.log" 2>&1
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 20 "$LOG_DIR/collect.log"
        echo "collect: \`pytest -m gpu\` did not collect (rc $rc, see $LOG_DIR/collect.log)"
        return 1
    fi
    echo "collect: $(tail -n 1 "$LOG_DIR/collect.log")"
}
if setup > "$LOG_DIR/setup.log" 2>&1; then
    cat "$LOG_DIR/setup.log"
    row setup ok "$SECONDS" "$(sed -n 's/^python: //p' "$LOG_DIR/setup.log"); $(grep '^collect:' "$LOG_DIR/setup.log")"
else
    cat "$LOG_DIR/setup.log"
    row setup FAIL "$SECONDS" "$(tail -n 1 "$LOG_DIR/setup.log")"
    finish 2 "setup failed"
fi
PY="$(sed -n 's/^python: \([^ ]*\) .*/\1/p' "$LOG_DIR/setup.log")"

# -- 2 device ---------------------------------------------------------------------------------------
"$PY" - > "$LOG_DIR/device.log" 2>&1 <<'PYTHON'
import os
import sys
from luminal_num.runtime.cuda_device import probe
if os.environ.get("LUMINAL_GPU_CHECK_NO_DEVICE"):
    print("no CUDA device: LUMINAL_GPU_CHECK_NO_DEVICE is set (the dry run)")
    sys.exit(3)
found = probe()
if not found.available:
    print(f"no CUDA device: {found.reason}")
    sys.exit(3)
print(f"device: {found.device_name} (sm_{found.compute_capability})")
PYTHON
device_rc=$?
if [ "$device_rc" -eq 0 ] && command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L >> "$LOG_DIR/device.log" 2>&1; fi
if [ "$device_rc" -eq 3 ]; then
    head -1 "$LOG_DIR/device.log"
    row device none "$SECONDS" "$(head -1 "$LOG_DIR/device.log")"
    finish 3 "no CUDA device"
elif [ "$device_rc" -ne 0 ]; then
    cat "$LOG_DIR/device.log"
    row device FAIL "$SECONDS" "see $LOG_DIR/device.log"
    finish 2 "device probe failed"
fi
row device ok "$SECONDS" "$(head -1 "$LOG_DIR/device.log")"

# -- 3..6 the device stages: all run; the exit code names the first that failed ---------------------
first_failure=0
run_stage() {  # name, exit code on failure, timeout, command...
    local name="$1" code="$2" limit="$3"; shift 3
    local started=$SECONDS
    timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$LOG_DIR/$name.log"
    if [ "$rc" -eq 0 ]; then
        row "$name" ok $((SECONDS - started)) "$(tail -n 1 "$LOG_DIR/$name.log")"
    else
        row "$name" FAIL $((SECONDS - started)) "rc=$rc$([ "$rc" -eq 124 ] && echo ' (timeout)'); see $LOG_DIR/$name.log"
        [ "$first_failure" -eq 0 ] && first_failure="$code"
    fi
}
wanted() { [ -z "${LUMINAL_GPU_STAGES:-}" ] || [[ " $LUMINAL_GPU_STAGES " == *" $1 "* ]]; }
wanted pytest && run_stage pytest 4 "$T_PYTEST" "$PY" -m pytest -m gpu -q -n 0 -p no:cacheprovider tests
wanted e2e && run_stage e2e 5 "$T_E2E" "$PY" scripts/gpu_check.py e2e
wanted graph && run_stage graph 6 "$T_GRAPH" "$PY" scripts/gpu_check.py graph
wanted timing && run_stage timing 7 "$T_TIMING" "$PY" scripts/gpu_check.py timing
wanted kernels && run_stage kernels 8 "$T_KERNELS" "$PY" scripts/gpu_stages.py kernels
wanted megakernel && run_stage megakernel 9 "$T_MEGAKERNEL" "$PY" scripts/gpu_stages.py megakernel
wanted fp8acc && run_stage fp8acc 10 "$T_FP8ACC" "$PY" scripts/gpu_stages.py fp8acc
if [ "$first_failure" -eq 0 ]; then finish 0 "all stages passed"; fi
finish "$first_failure" "a stage failed"
