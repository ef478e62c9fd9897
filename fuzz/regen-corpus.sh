#!/usr/bin/env bash
# Regenerates the seed corpus of the fuzz targets (fuzz/corpus/TARGET/)
# from real traffic and real artefacts:
#   frame      request frames the server tests send to a sim server
#   session    whole sessions (frames with their bulk) of those tests
#              (recorded by server/tests/common's DataClient)
#   module     nvcc's fatbins and cubins (server/tests/fixtures, and a few
#              integration/cuda programs), PTX images, a link bundle
#   ptx        PTX nvcc writes for integration/cuda, and CuPy's kernels
#              from its kernel cache (after `integration/libraries` ran)
#   snapshot   sim sessions captured as files and as live-migration streams
#   capnp_msg, token
#              control-plane and broker messages recorded between the real
#              clients and servers, tokens, credentials and key files the
#              code issues (fuzz-targets/tests/regen.rs)
# Needs nvcc (bash integration/setup-cuda.sh installs it in
# ~/.cache/rgpu/cuda-venv). Files over 32 KiB are left out: small seeds
# keep the fuzzer fast. Run from anywhere: bash fuzz/regen-corpus.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
C=fuzz/corpus
MAX=32768
NVCC=${RGPU_NVCC:-$HOME/.cache/rgpu/cuda-venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc}
CUPY_CACHE=${CUPY_CACHE:-$HOME/.cache/rgpu/libs-venv/cupy-cache}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

small() { [ "$(stat -c %s "$1")" -le $MAX ]; }
keep() { # keep SRC TARGET NAME
    if small "$1"; then cp "$1" "$C/$2/$3"; fi
}

rm -rf "$C" && mkdir -p "$C"/{frame,session,module,ptx,capnp_msg,token,snapshot}

# frame and session: what the server tests send (each request frame, and
# each whole session of at most 32 KiB with its bulk).
RGPU_FUZZ_RECORD="$ROOT/$C/frame" cargo test --release -p rgpu-server \
    --test data_plane --test module_image --test ipc -- --test-threads=1 >/dev/null

# module: nvcc's images.
for f in server/tests/fixtures/*.fatbin server/tests/fixtures/*.cubin server/tests/fixtures/*.ptx; do
    keep "$f" module "$(basename "$f")"
done
for src in rt_kernels rt_globals rt_launch rt_funcattr; do
    "$NVCC" -cubin -arch=sm_90 -I integration/cuda "integration/cuda/$src.cu" -o "$TMP/$src.sm_90.cubin"
    "$NVCC" -fatbin -I integration/cuda "integration/cuda/$src.cu" -o "$TMP/$src.fatbin"
    keep "$TMP/$src.sm_90.cubin" module "$src.sm_90.cubin"
    keep "$TMP/$src.fatbin" module "$src.fatbin"
done

# ptx: nvcc's PTX, and CuPy's.
for f in integration/cuda/*.cu integration/cuda/modules/*.cu; do
    n=$(basename "$f" .cu)
    if "$NVCC" -ptx -arch=sm_90 -rdc=true -I integration/cuda -I integration/cuda/modules "$f" -o "$TMP/$n.ptx" 2>/dev/null; then
        keep "$TMP/$n.ptx" ptx "$n.ptx"
    fi
done
for f in server/tests/fixtures/*.ptx; do keep "$f" ptx "$(basename "$f")"; done
if [ -d "$CUPY_CACHE" ]; then
    # A cache file is CuPy's 40-digit hash, then the kernel's PTX. A spread
    # of sizes, at most 16.
    ls -S "$CUPY_CACHE" | awk 'NR % 600 == 1' | head -16 | while read -r f; do
        tail -c +41 "$CUPY_CACHE/$f" > "$TMP/cupy-$f.ptx"
        keep "$TMP/cupy-$f.ptx" ptx "cupy-${f%.cubin}.ptx"
    done
fi

# capnp_msg and token (and the module target's link bundle).
RGPU_FUZZ_CORPUS="$ROOT/$C" cargo test --release -p rgpu-fuzz-targets --test regen -- --ignored >/dev/null

for t in frame session module ptx capnp_msg token snapshot; do
    echo "$t: $(ls "$C/$t" | wc -l) files, $(du -sh "$C/$t" | cut -f1)"
done
