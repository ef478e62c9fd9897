#!/usr/bin/env bash
# Real CUDA libraries through rgpu on the sim: CuPy, numba-cuda, NVML clients and (with --full)
# PyTorch, installed from PyPI (pinned) into cached venvs under ${RGPU_CUDA_CACHE:-~/.cache/rgpu},
# each check and each library's own test suite run unmodified under `rgpu run` against sim
# servers on loopback. Prints one line per check or suite and "N passed, M failed"; exits
# non-zero on a failure or when a suite passes fewer tests than integration/libraries/baseline.txt.
# Needs `cargo build --release` first.
#
#   bash integration/libraries/run.sh          # CI: the checks, numba-cuda's cudadrv suite
#                                              # and its cudapy suite less its slowest files
#   bash integration/libraries/run.sh --full   # also PyTorch (a 5 GB venv), numba-cuda's
#                                              # whole cudapy suite and CuPy's suite (parts)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
FULL=0
[[ "${1:-}" == "--full" ]] && FULL=1
CACHE="${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}"

venv() { # venv DIR PINS... : a venv holding exactly these pins (reinstalled when they change)
    local dir=$1; shift
    if [[ ! -f "$dir/.rgpu-pins" || "$(cat "$dir/.rgpu-pins")" != "$*" ]]; then
        echo "libraries: installing $* into $dir" >&2
        python3 -m venv "$dir"
        "$dir/bin/pip" install -q --disable-pip-version-check "$@"
        echo "$*" > "$dir/.rgpu-pins"
    fi
}
PYTEST_PINS=("pytest==9.2.0" "pytest-timeout==2.4.0")
VENV="${RGPU_LIBS_VENV:-$CACHE/libs-venv}"
venv "$VENV" "cupy-cuda13x==14.2.0" "numba-cuda[cu13]==0.30.4" "nvidia-ml-py==13.615.71" \
    "nvidia-cublas==13.10.0.20" "${PYTEST_PINS[@]}"
# numba-cuda without nvJitLink, so that it links with the driver's cuLink* and hands rgpu PTX
# (with nvJitLink it links to SASS-only cubins the sim cannot run; docs/compatibility.md).
NUMBA_VENV="${RGPU_NUMBA_PTX_VENV:-$CACHE/numba-ptx-venv}"
venv "$NUMBA_VENV" "numba-cuda==0.30.4" "cuda-bindings==13.5.0" "cuda-core==1.2.2" "nvidia-nvvm==13.5.37" \
    "nvidia-cuda-nvrtc==13.5.37" "nvidia-cuda-runtime==13.5.37" "filecheck==1.0.6" "ml_dtypes==0.7.0" \
    "cffi==2.1.1" "nvidia-cuda-cccl==13.3.5.0.6" "${PYTEST_PINS[@]}"
if [[ $FULL == 1 ]]; then
    TORCH_VENV="${RGPU_TORCH_VENV:-$CACHE/torch-venv}"
    venv "$TORCH_VENV" "torch==2.15.0" "numpy==2.4.6"
    # CuPy's tests come with its source distribution (checked against PyPI's digest).
    CUPY_SRC="$CACHE/src/cupy-14.2.0"
    if [[ ! -d "$CUPY_SRC/tests" ]]; then
        mkdir -p "$CACHE/src"
        curl -sfL -o "$CACHE/src/cupy-14.2.0.tar.gz" \
            "https://files.pythonhosted.org/packages/dc/10/059a92d40b161ea24607c9e41a75098812ca7021f2b565524f87beba15c9/cupy-14.2.0.tar.gz"
        echo "cfed725e612178cfbdbf62f4a3a598b60edecbbca718c0d4580c21a16ae4a62c  $CACHE/src/cupy-14.2.0.tar.gz" | sha256sum -c --quiet
        tar xzf "$CACHE/src/cupy-14.2.0.tar.gz" -C "$CACHE/src" cupy-14.2.0/tests
    fi
fi
PY="$VENV/bin/python"
RGPU="$ROOT/target/release/rgpu"
SERVER="$ROOT/target/release/rgpu-server"
[[ -x "$RGPU" && -x "$SERVER" ]] || { echo "libraries: run cargo build --release first" >&2; exit 1; }
# CuPy compiles its kernels to PTX for the sim; its raw-kernel tests want nvcc's version.
export CUPY_COMPILE_WITH_PTX=1 CUPY_CACHE_DIR="$VENV/cupy-cache"
NVCC_FOUND=$(ls "$CACHE"/cuda-venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1 || true)
[[ -n "$NVCC_FOUND" ]] && export NVCC="$NVCC_FOUND"

LOGS=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$LOGS"' EXIT
# Loopback servers, so plaintext, said on both ends (the TLS path has its
# own tests: integration/tests/tls.rs, server/tests/tls.rs).
export RGPU_PLAINTEXT=1
unset RGPU_TLS_CA
start() { # start NAME CC -> prints the address
    "$SERVER" --listen 127.0.0.1:0 --backend sim --sim-memory 4GiB --sim-compute-capability "$2" --plaintext \
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
    if timeout 600 "$RGPU" run --server "$server" -- "${PYTHON_FOR:-$PY}" "integration/libraries/checks/$script" "$@" \
        > "$LOGS/$name.out" 2>&1; then
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
check cupy-cublas "$SM120" cupy_cublas.py
check cupy-partition-on-12.0 "$SM120" cupy_partition.py
check cupy-ipc "$SM90" cupy_ipc.py
check numba-copies "$SM90" numba_copies.py
PYTHON_FOR="$NUMBA_VENV/bin/python" check numba-kernels "$SM90" numba_kernels.py
check pynvml-9.0 "$SM90" pynvml_devices.py 9.0
check pynvml-12.0 "$SM120" pynvml_devices.py 12.0
[[ $FULL == 1 ]] && PYTHON_FOR="$TORCH_VENV/bin/python" check pytorch "$SM90" torch_basics.py 9.0

# The libraries' own test suites: the pass count of each may only grow
# (integration/libraries/baseline.txt; docs/compatibility.md says what fails and why).
verdict() { # verdict NAME RAN OK FAILS ERRS SKIPS
    local name=$1 ran=$2 ok=$3 want
    want=$(sed -n "s/^$name passed \([0-9]*\)$/\1/p" integration/libraries/baseline.txt)
    local summary="$name: ran $ran, $ok passed, $4 failed, $5 errors, $6 skipped (baseline ${want:-none} passed)"
    if [[ $ran -gt 0 && ( -z "$want" || $ok -ge $want ) ]]; then
        echo "PASS $summary"; passed=$((passed + 1))
    else
        echo "FAIL $summary"; tail -30 "$LOGS/$name.out" | sed 's/^/    /'; failed=$((failed + 1))
    fi
}
unittest_suite() { # unittest_suite NAME MODULE: numba's own runner
    local name=$1 module=$2
    (cd "$LOGS" && timeout 900 "$RGPU" run --server "$SM90" -- "$NUMBA_VENV/bin/python" -W ignore \
        -m numba.runtests "$module" > "$LOGS/$name.out" 2>&1) || true
    local ran fails errs skips
    ran=$(sed -n 's/^Ran \([0-9]*\) tests.*/\1/p' "$LOGS/$name.out")
    fails=$(grep -o 'failures=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    errs=$(grep -o 'errors=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    skips=$(grep -o 'skipped=[0-9]*' "$LOGS/$name.out" | tail -1 | cut -d= -f2)
    verdict "$name" "${ran:-0}" $(( ${ran:-0} - ${fails:-0} - ${errs:-0} - ${skips:-0} )) "${fails:-0}" "${errs:-0}" "${skips:-0}"
}
pytest_suite() { # pytest_suite NAME SERVER PYTHON DIR LIMIT ARGS...: counted from pytest's JUnit report
    local name=$1 server=$2 python=$3 dir=$4 limit=$5; shift 5
    (cd "$dir" && PYTHONPATH="$ROOT/integration/libraries/pytest" timeout "$limit" "$RGPU" run --server "$server" -- \
        "$python" -W ignore -m pytest -q -p rgpu_suite_plugin -p no:cacheprovider --timeout=300 \
        --junitxml="$LOGS/$name.xml" "$@" > "$LOGS/$name.out" 2>&1) || true
    local counts
    counts=$("$python" - "$LOGS/$name.xml" <<'EOF' || echo "0 0 0 0 0"
import sys, xml.etree.ElementTree as ET
ran = ok = f = e = s = 0
for t in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    kinds = {c.tag for c in t}
    ran += 1
    if "skipped" in kinds: s += 1
    elif "error" in kinds: e += 1
    elif "failure" in kinds: f += 1
    else: ok += 1
print(ran, ok, f, e, s)
EOF
)
    # shellcheck disable=SC2086
    verdict "$name" $counts
}
unittest_suite numba-cudadrv-suite numba.cuda.tests.cudadrv
# The cudapy files left out of CI take over seven of its fifteen minutes here (pickling kernels
# into subprocesses, the on-disk cache, a large matmul); --full runs them.
SLOW_CUDAPY=(test_serialize test_caching test_matmul test_retrieve_autoconverted_arrays test_print)
if [[ $FULL == 1 ]]; then
    pytest_suite numba-cudapy-suite "$SM90" "$NUMBA_VENV/bin/python" "$LOGS" 3600 \
        --import-mode=importlib --pyargs numba.cuda.tests.cudapy
    pytest_suite cupy-suite "$SM120" "$PY" "$CUPY_SRC/tests" 7200 -m "not slow" \
        cupy_tests/creation_tests cupy_tests/manipulation_tests cupy_tests/sorting_tests cupy_tests/statistics_tests
else
    # Named module by module (pytest's --ignore does not reach modules found through --pyargs).
    modules=()
    for f in "$NUMBA_VENV"/lib/python3*/site-packages/numba_cuda/numba/cuda/tests/cudapy/test_*.py; do
        m=$(basename "$f" .py)
        [[ " ${SLOW_CUDAPY[*]} " == *" $m "* ]] || modules+=("numba.cuda.tests.cudapy.$m")
    done
    pytest_suite numba-cudapy-ci-suite "$SM90" "$NUMBA_VENV/bin/python" "$LOGS" 1800 \
        --import-mode=importlib --pyargs "${modules[@]}"
fi
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
