#!/usr/bin/env bash
# Real CUDA libraries through rgpu on the sim: CuPy and numba-cuda, installed
# from PyPI (pinned) into ${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/libs-venv, each
# check run unmodified under `rgpu run` against sim servers on loopback.
# Prints one line per check and "N passed, M failed"; exits non-zero on a
# failure. Needs `cargo build --release` first.
#
#   bash integration/libraries/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PINS=("cupy-cuda13x==14.2.0" "numba-cuda[cu13]==0.30.4" "nvidia-ml-py==13.615.71")
VENV="${RGPU_LIBS_VENV:-${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/libs-venv}"
STAMP="$VENV/.rgpu-pins"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "${PINS[*]}" ]]; then
    echo "libraries: installing ${PINS[*]} into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
    echo "${PINS[*]}" > "$STAMP"
fi
# numba-cuda without nvJitLink, so that it links with the driver's cuLink* and hands rgpu PTX
# (with nvJitLink it links to SASS-only cubins the sim cannot run; docs/compatibility.md).
NUMBA_PINS=("numba-cuda==0.30.4" "cuda-bindings==13.5.0" "cuda-core==1.2.2" "nvidia-nvvm==13.5.37"
    "nvidia-cuda-nvrtc==13.5.37" "nvidia-cuda-runtime==13.5.37" "pytest==9.2.0" "filecheck==1.0.6"
    "ml_dtypes==0.7.0")
NUMBA_VENV="${RGPU_NUMBA_PTX_VENV:-${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/numba-ptx-venv}"
if [[ ! -f "$NUMBA_VENV/.rgpu-pins" || "$(cat "$NUMBA_VENV/.rgpu-pins")" != "${NUMBA_PINS[*]}" ]]; then
    echo "libraries: installing ${NUMBA_PINS[*]} into $NUMBA_VENV" >&2
    python3 -m venv "$NUMBA_VENV"
    "$NUMBA_VENV/bin/pip" install -q --disable-pip-version-check "${NUMBA_PINS[@]}"
    echo "${NUMBA_PINS[*]}" > "$NUMBA_VENV/.rgpu-pins"
fi
PY="$VENV/bin/python"
RGPU="$ROOT/target/release/rgpu"
SERVER="$ROOT/target/release/rgpu-server"
[[ -x "$RGPU" && -x "$SERVER" ]] || { echo "libraries: run cargo build --release first" >&2; exit 1; }

LOGS=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$LOGS"' EXIT
start() { # start NAME CC -> prints the address
    "$SERVER" --listen 127.0.0.1:0 --backend sim --sim-memory 2GiB --sim-compute-capability "$2" \
        > "$LOGS/$1.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do
        addr=$(sed -n 's/.*listening on \(127\.0\.0\.1:[0-9]*\).*/\1/p' "$LOGS/$1.log")
        [[ -n "$addr" ]] && { echo "$addr"; return; }
        sleep 0.1
    done
    echo "libraries: server $1 did not start" >&2; cat "$LOGS/$1.log" >&2; exit 1
}
SM90=$(start sm90 9.0)
SM120=$(start sm120 12.0)

passed=0 failed=0
check() { # check NAME SERVER SCRIPT ARGS...
    local name=$1 server=$2 script=$3; shift 3
    if CUPY_COMPILE_WITH_PTX=1 CUPY_CACHE_DIR="$VENV/cupy-cache" timeout 600 \
        "$RGPU" run --server "$server" -- "${PYTHON_FOR:-$PY}" "integration/libraries/checks/$script" "$@" > "$LOGS/$name.out" 2>&1; then
        echo "PASS $name: $(grep '^ok:' "$LOGS/$name.out" | tail -1)"
        passed=$((passed + 1))
    else
        echo "FAIL $name"; tail -20 "$LOGS/$name.out" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}
check cupy-elementwise "$SM90" cupy_elementwise.py
check cupy-cub-on-12.0 "$SM120" cupy_cub.py right
check cupy-cub-on-9.0 "$SM90" cupy_cub.py error
check cupy-graph "$SM90" cupy_graph.py
check numba-copies "$SM90" numba_copies.py
PYTHON_FOR="$NUMBA_VENV/bin/python" check numba-kernels "$SM90" numba_kernels.py
check pynvml-9.0 "$SM90" pynvml_devices.py 9.0
check pynvml-12.0 "$SM120" pynvml_devices.py 12.0
# numba-cuda's own test suite (shipped in its wheel), the driver-level part: its pass count
# may only grow (integration/libraries/baseline.txt; docs/compatibility.md says what fails).
suite() { # suite NAME MODULE
    local name=$1 module=$2 want
    want=$(sed -n "s/^$name passed \([0-9]*\)$/\1/p" integration/libraries/baseline.txt)
    (cd "$LOGS" && timeout 900 "$RGPU" run --server "$SM90" -- "$NUMBA_VENV/bin/python" -W ignore \
        -m numba.runtests "$module" > "$LOGS/$name.out" 2>&1) || true
    local ran fails errs skips
    ran=$(sed -n 's/^Ran \([0-9]*\) tests.*/\1/p' "$LOGS/$name.out")
    fails=$(grep -o 'failures=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    errs=$(grep -o 'errors=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    skips=$(grep -o 'skipped=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    local ok=$(( ${ran:-0} - ${fails:-0} - ${errs:-0} - ${skips:-0} ))
    local summary="$name: ran ${ran:-0}, $ok passed, ${fails:-0} failed, ${errs:-0} errors, ${skips:-0} skipped (baseline ${want:-?} passed)"
    if [[ -n "$ran" && -n "$want" && $ok -ge $want ]]; then
        echo "PASS $summary"; passed=$((passed + 1))
    else
        echo "FAIL $summary"; tail -20 "$LOGS/$name.out" | sed 's/^/    /'; failed=$((failed + 1))
    fi
}
suite numba-cudadrv-suite numba.cuda.tests.cudadrv
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
