#!/usr/bin/env bash
# Installs the CUDA toolchain the integration suite needs, from PyPI, into a
# virtual environment, with no GPU and no system CUDA:
#   nvcc 13 + its headers, NVIDIA's libcudart.so.13 (and libcudart_static.a),
#   and NVIDIA's libcudart.so.12 with its headers (for the cudart-12 variant).
#
# The venv lives in ${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/cuda-venv, or in
# $RGPU_CUDA_VENV when that is set. Running this again is fast: it only checks
# that the pinned versions are there.
#
# It writes $VENV/rgpu-cuda.env (shell syntax, `source` it) naming nvcc and
# both runtimes, and prints the same lines. The Rust harness finds the venv by
# itself (same default path, or $RGPU_CUDA_VENV); sourcing the file is only
# needed for using the toolchain by hand.
set -euo pipefail

# Pinned to the versions the suite was written and checked against.
PINS=(
    "nvidia-cuda-nvcc==13.5.37"
    "nvidia-cuda-runtime==13.5.37"
    "nvidia-cuda-crt==13.5.37"
    "nvidia-nvvm==13.5.37"
    "nvidia-cuda-cccl==13.3.5.0.6"
    "nvidia-cuda-runtime-cu12==12.9.79"
)

VENV="${RGPU_CUDA_VENV:-${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/cuda-venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.rgpu-pins"
WANT="$(printf '%s\n' "${PINS[@]}")"

say() { printf 'setup-cuda: %s\n' "$*" >&2; }

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    say "error: $PYTHON not found; install Python 3 (Debian: apt-get install python3 python3-venv)"
    exit 1
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    say "toolchain already installed in $VENV"
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        say "creating virtual environment $VENV"
        mkdir -p "$(dirname "$VENV")"
        if ! "$PYTHON" -m venv "$VENV" 2>/tmp/rgpu-venv-err.$$; then
            cat /tmp/rgpu-venv-err.$$ >&2 || true
            rm -f /tmp/rgpu-venv-err.$$
            rm -rf "$VENV"
            PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo 3)"
            say "error: '$PYTHON -m venv' failed; on Debian/Ubuntu install the venv module:"
            say "       apt-get install python3-venv   (or python${PYVER}-venv)"
            exit 1
        fi
        rm -f /tmp/rgpu-venv-err.$$
    fi
    say "installing ${PINS[*]}"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"
    printf '%s\n' "$WANT" >"$STAMP"
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CU13="$SITE/nvidia/cu13"
CU12="$SITE/nvidia/cuda_runtime"
NVCC="$CU13/bin/nvcc"

for f in "$NVCC" "$CU13/include/cuda_runtime.h" "$CU13/lib/libcudart.so.13" \
         "$CU13/lib/libcudart_static.a" "$CU12/include/cuda_runtime.h" "$CU12/lib/libcudart.so.12"; do
    if [[ ! -e "$f" ]]; then
        say "error: expected $f after installing; delete $VENV and run again"
        exit 1
    fi
done

# The wheels ship only the versioned names; `-lcudart` needs libcudart.so.
ln -sfn libcudart.so.13 "$CU13/lib/libcudart.so"
ln -sfn libcudart.so.12 "$CU12/lib/libcudart.so"

ENVFILE="$VENV/rgpu-cuda.env"
cat >"$ENVFILE" <<EOF
export RGPU_CUDA_VENV="$VENV"
export RGPU_NVCC="$NVCC"
export RGPU_CUDA13_INCLUDE="$CU13/include"
export RGPU_CUDA13_LIB="$CU13/lib"
export RGPU_CUDA12_INCLUDE="$CU12/include"
export RGPU_CUDA12_LIB="$CU12/lib"
EOF

"$NVCC" --version | tail -n 2 >&2
say "wrote $ENVFILE:"
cat "$ENVFILE"
