#!/usr/bin/env bash
# gpu-check: rgpu against the GPU it runs on, on a machine with an NVIDIA GPU.
#
# Builds rgpu (release), starts `rgpu-server --backend cuda` on loopback and
# runs, each natively (NVIDIA's libcuda.so.1) and through rgpu (`rgpu run`):
#   - the integration suite's programs (integration/cuda/rt_*.cu and
#     drv_api.cu), built for this GPU's architecture and as PTX;
#   - a host<->device bandwidth test, 4 KiB .. 256 MiB, pinned and pageable;
#   - a launch-rate test (and the latency of one synchronisation);
#   - a PyTorch workload, when `python3 -c 'import torch'` works here;
# and, through rgpu only, a session moved between two more servers on the
# same GPU with --cuda-movable-memory (rt_checkpoint migrated A -> B -> A
# mid-run, its results checked; the pause of each move).
# It prints one table (markdown) with each result natively and through rgpu
# and the rgpu/native ratio of time and bandwidth, and writes it to --out.
# Everything is bounded so that the whole check finishes within 8 minutes.
#
# Usage: integration/gpu-check.sh [options]
#   --skip-build       use the binaries already in $CARGO_TARGET_DIR/release
#   --build-only       build rgpu and the programs, then stop (needs no GPU)
#   --arch sm_XY       GPU architecture (default: from nvidia-smi)
#   --out FILE         also write the table there (default: gpu-check.md in
#                      the work directory)
#   --work DIR         where programs and logs go (default: $TARGET/gpu-check)
#   --max-copy BYTES   largest bandwidth size (default 268435456)
#   --launches N       launches for the launch rate (default 20000)
#   --no-torch         skip the PyTorch workload
#   -h, --help         this text
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
SKIP_BUILD=0 BUILD_ONLY=0 ARCH="" OUT="" WORK="" MAX_COPY=$((256 << 20)) LAUNCHES=20000 TORCH=1
START_S=$SECONDS

die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }
say() { printf 'gpu-check: %s\n' "$*" >&2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-build) SKIP_BUILD=1 ;;
        --build-only) BUILD_ONLY=1 ;;
        --arch) ARCH="${2:?--arch needs a value, e.g. sm_90}"; shift ;;
        --out) OUT="${2:?--out needs a file}"; shift ;;
        --work) WORK="${2:?--work needs a directory}"; shift ;;
        --max-copy) MAX_COPY="${2:?--max-copy needs a byte count}"; shift ;;
        --launches) LAUNCHES="${2:?--launches needs a number}"; shift ;;
        --no-torch) TORCH=0 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option $1" ;;
    esac
    shift
done
[[ "$MAX_COPY" =~ ^[0-9]+$ && "$MAX_COPY" -ge 4096 ]] || die "--max-copy must be a byte count >= 4096"
[[ "$LAUNCHES" =~ ^[0-9]+$ && "$LAUNCHES" -ge 100 ]] || die "--launches must be a number >= 100"
if [[ -n "$ARCH" && ! "$ARCH" =~ ^sm_[0-9]+[a-z]?$ ]]; then die "--arch must look like sm_90"; fi

WORK="${WORK:-$TARGET/gpu-check}"
OUT="${OUT:-$WORK/gpu-check.md}"
BIN="$TARGET/release"
mkdir -p "$WORK/bin" "$WORK/logs"

# --- the GPU --------------------------------------------------------------
if [[ -z "$ARCH" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 \
        && cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)" \
        && [[ "$cc" =~ ^[0-9]+\.[0-9]+$ ]]; then
        ARCH="sm_${cc/./}"
    elif [[ "$BUILD_ONLY" == 1 ]]; then
        ARCH="sm_90"
        say "no nvidia-smi; building for $ARCH"
    else
        die "no NVIDIA GPU found (nvidia-smi missing or silent); this check needs one (--build-only works without)"
    fi
fi
COMPUTE="compute_${ARCH#sm_}"
say "architecture $ARCH (+ $COMPUTE PTX)"

# --- build ----------------------------------------------------------------
if [[ "$SKIP_BUILD" == 0 ]]; then
    say "building rgpu (release)"
    (cd "$ROOT" && cargo build --release -p rgpu-server -p rgpu-client-shim -p rgpu-cli) >&2
fi
for f in rgpu rgpu-server libcuda.so; do
    [[ -e "$BIN/$f" ]] || die "$BIN/$f is missing (build with: cargo build --release)"
done

say "CUDA toolchain"
bash "$ROOT/integration/setup-cuda.sh" >/dev/null
VENV="${RGPU_CUDA_VENV:-${RGPU_CUDA_CACHE:-$HOME/.cache/rgpu}/cuda-venv}"
# shellcheck disable=SC1091
source "$VENV/rgpu-cuda.env"
NVCC="$RGPU_NVCC"

PROGRAMS=(rt_device rt_memory rt_copy rt_memset rt_stream rt_event rt_pinned rt_globals rt_funcattr rt_launch rt_errors rt_graph)
GENCODE=(-gencode "arch=$COMPUTE,code=$ARCH" -gencode "arch=$COMPUTE,code=$COMPUTE")
RT_FLAGS=(-std=c++17 -O2 "${GENCODE[@]}" -cudart shared -L "$RGPU_CUDA13_LIB" -Xlinker "-rpath,$RGPU_CUDA13_LIB")

build_one() { # name src extra-flags...
    local name="$1" src="$2"; shift 2
    "$NVCC" "$@" -o "$WORK/bin/$name" "$src" >"$WORK/logs/build-$name.log" 2>&1 \
        || { cat "$WORK/logs/build-$name.log" >&2; return 1; }
}
say "building the programs with nvcc"
pids=()
for p in "${PROGRAMS[@]}"; do
    build_one "$p" "$ROOT/integration/cuda/$p.cu" "${RT_FLAGS[@]}" -I "$ROOT/integration/cuda" & pids+=($!)
done
build_one bandwidth "$ROOT/integration/gpu-check/bandwidth.cu" "${RT_FLAGS[@]}" & pids+=($!)
build_one launch_rate "$ROOT/integration/gpu-check/launch_rate.cu" "${RT_FLAGS[@]}" & pids+=($!)
build_one rt_checkpoint "$ROOT/integration/cuda/rt_checkpoint.cu" "${RT_FLAGS[@]}" -I "$ROOT/integration/cuda" & pids+=($!)
# Driver API: linked against the shim's libcuda.so; at run time natively
# the loader finds NVIDIA's libcuda.so.1 (the shim's name is the same).
build_one drv_api "$ROOT/integration/cuda/drv_api.cu" -x c++ -std=c++17 -O2 -cudart none \
    -I "$ROOT/integration/cuda" -L "$BIN" -lcuda & pids+=($!)
fail=0
for pid in "${pids[@]}"; do wait "$pid" || fail=1; done
[[ "$fail" == 0 ]] || die "a program did not build (logs in $WORK/logs)"
say "built in $((SECONDS - START_S)) s"
if [[ "$BUILD_ONLY" == 1 ]]; then
    say "--build-only: programs are in $WORK/bin"
    exit 0
fi

# --- the server -------------------------------------------------------------
SERVER_LOG="$WORK/logs/server.log"
# Loopback, so plaintext on both ends (TLS has its own tests).
export RGPU_PLAINTEXT=1
unset RGPU_TLS_CA
"$BIN/rgpu-server" --listen 127.0.0.1:0 --backend cuda --plaintext >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
MOVE_PIDS=()
cleanup() {
    for pid in "$SERVER_PID" ${MOVE_PIDS[@]+"${MOVE_PIDS[@]}"}; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT
ADDR=""
for _ in $(seq 100); do
    ADDR="$(grep -o 'listening on [0-9.]*:[0-9]*' "$SERVER_LOG" | head -n1 | awk '{print $3}')" || true
    [[ -n "$ADDR" ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$SERVER_LOG" >&2; die "rgpu-server --backend cuda exited"; }
    sleep 0.1
done
[[ -n "$ADDR" ]] || { cat "$SERVER_LOG" >&2; die "rgpu-server did not start listening within 10 s"; }
grep -q 'backend cuda' "$SERVER_LOG" || die "server is not on the cuda backend: $(head -n3 "$SERVER_LOG")"
say "rgpu-server (cuda backend) on $ADDR"

# --- running ----------------------------------------------------------------
# run_pair NAME TIMEOUT CMD...: runs CMD natively and through rgpu; leaves
# outputs in $WORK/logs/NAME.{native,rgpu}.out and times in NAT_S / RG_S,
# exit codes in NAT_RC / RG_RC.
run_pair() {
    local name="$1" limit="$2"; shift 2
    local t0
    t0=$(date +%s.%N)
    NAT_RC=0; timeout "$limit" "$@" >"$WORK/logs/$name.native.out" 2>&1 || NAT_RC=$?
    NAT_S=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN {print a - b}')
    t0=$(date +%s.%N)
    RG_RC=0; timeout "$limit" "$BIN/rgpu" run --server "$ADDR" -- "$@" >"$WORK/logs/$name.rgpu.out" 2>&1 || RG_RC=$?
    RG_S=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN {print a - b}')
}
ratio() { # b a -> b/a with 2 decimals, "-" when either is missing or a is 0
    awk -v b="${1:-}" -v a="${2:-}" 'BEGIN { if (b == "" || a == "" || a + 0 == 0) print "-"; else printf "%.2f", b / a }'
}
verdict() { [[ "$1" == 0 ]] && echo PASS || echo "FAIL($1)"; }
ROWS=()
row() { ROWS+=("| $1 | $2 | $3 | $4 |"); }

for p in "${PROGRAMS[@]}" drv_api; do
    args=()
    [[ "$p" == rt_launch ]] && args=(--expect-supported)
    run_pair "$p" 60 "$WORK/bin/$p" ${args[@]+"${args[@]}"}
    row "$p" "$(verdict $NAT_RC) $(printf '%.2f' "$NAT_S") s" "$(verdict $RG_RC) $(printf '%.2f' "$RG_S") s" \
        "$(ratio "$RG_S" "$NAT_S") (time)"
done

run_pair bandwidth 180 "$WORK/bin/bandwidth" "$MAX_COPY"
row "bandwidth (bytes checked)" "$(verdict $NAT_RC)" "$(verdict $RG_RC)" ""
while read -r _ dir mem size mibs; do
    rg="$(awk -v d="$dir" -v m="$mem" -v s="$size" '$1=="bw" && $2==d && $3==m && $4==s {print $5}' \
        "$WORK/logs/bandwidth.rgpu.out")"
    human="$(numfmt --to=iec-i --suffix=B "$size" 2>/dev/null || echo "$size B")"
    row "bw $dir $mem $human" "$mibs MiB/s" "${rg:--} MiB/s" "$(ratio "$rg" "$mibs")"
done < <(grep '^bw ' "$WORK/logs/bandwidth.native.out" || true)

run_pair launch_rate 120 "$WORK/bin/launch_rate" "$LAUNCHES"
row "launch_rate (results checked)" "$(verdict $NAT_RC)" "$(verdict $RG_RC)" ""
for key in launch_rate sync_us; do
    n="$(awk -v k="$key" '$1==k {print $2}' "$WORK/logs/launch_rate.native.out")"
    r="$(awk -v k="$key" '$1==k {print $2}' "$WORK/logs/launch_rate.rgpu.out")"
    unit="launches/s"; [[ "$key" == sync_us ]] && unit="us per sync"
    row "$key" "${n:--} $unit" "${r:--} $unit" "$(ratio "$r" "$n")"
done

if [[ "$TORCH" == 1 ]] && python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    run_pair torch 150 python3 "$ROOT/integration/gpu-check/torch_check.py"
    row "torch workload" "$(verdict $NAT_RC) $(printf '%.2f' "$NAT_S") s" "$(verdict $RG_RC) $(printf '%.2f' "$RG_S") s" \
        "$(ratio "$RG_S" "$NAT_S") (time)"
    while read -r _ key val; do
        r="$(awk -v k="$key" '$1=="torch" && $2==k {print $3}' "$WORK/logs/torch.rgpu.out")"
        case "$key" in
            *_s) row "torch $key" "$val s" "${r:--} s" "$(ratio "$r" "$val") (time)" ;;
            *) row "torch $key" "$val" "${r:--}" "$([[ "$val" == "$r" ]] && echo same || echo DIFFERENT)" ;;
        esac
    done < <(grep '^torch ' "$WORK/logs/torch.native.out" || true)
else
    row "torch workload" "not run" "not run" "no PyTorch with CUDA here (or --no-torch)"
fi

# --- sessions that move (docs/migration.md, movable memory) ----------------
MOVE_DIR="$WORK/move"
rm -rf "$MOVE_DIR"
mkdir -p "$MOVE_DIR/snapshots"
od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$MOVE_DIR/admin.key"
# start_move_server NAME: a cuda server with movable memory; its address in MOVE_ADDR.
start_move_server() {
    local log="$WORK/logs/$1.log"
    "$BIN/rgpu-server" --listen 127.0.0.1:0 --backend cuda --plaintext --cuda-movable-memory \
        --admin-key-file "$MOVE_DIR/admin.key" --checkpoint-dir "$MOVE_DIR/snapshots" >"$log" 2>&1 &
    MOVE_PIDS+=($!)
    MOVE_ADDR=""
    for _ in $(seq 100); do
        MOVE_ADDR="$(grep -o 'listening on [0-9.]*:[0-9]*' "$log" | head -n1 | awk '{print $3}')" || true
        [[ -n "$MOVE_ADDR" ]] && return 0
        sleep 0.1
    done
    return 1
}
# wait_line FILE TEXT SECONDS
wait_line() {
    local end=$((SECONDS + $3))
    while ((SECONDS < end)); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
    return 1
}
MOVE_NOTE="" MOVE_RC=1 HELD=()
if start_move_server move-a && MA="$MOVE_ADDR" && start_move_server move-b && MB="$MOVE_ADDR"; then
    "$BIN/rgpu" run --server "$MA" -- "$WORK/bin/rt_checkpoint" --rounds 6 --wait-ms 300 --mib 256 \
        >"$WORK/logs/move.out" 2>&1 &
    RUN_PID=$!
    for step in "round 1 $MA $MB" "round 3 $MB $MA"; do
        read -r _ n from to <<<"$step"
        if ! wait_line "$WORK/logs/move.out" "^round $n\$" 30; then MOVE_NOTE="never reached round $n"; break; fi
        id="$(grep -o 'session{id=0x[0-9a-f]*' "$WORK/logs/move-a.log" | head -n1 | cut -d= -f2)"
        if ! out="$("$BIN/rgpu" migrate "$id" --server "$from" --to "$to" --key-file "$MOVE_DIR/admin.key" --plaintext 2>&1)"; then
            MOVE_NOTE="migration $from -> $to refused: $(echo "$out" | tail -n1)"
            break
        fi
        HELD+=("$(echo "$out" | grep -o 'was held [0-9.]* ms' | awk '{print $3}')")
    done
    timeout 60 tail --pid="$RUN_PID" -f /dev/null || kill "$RUN_PID" 2>/dev/null || true
    MOVE_RC=0; wait "$RUN_PID" || MOVE_RC=$?
else
    MOVE_NOTE="a server with --cuda-movable-memory did not start (logs/move-*.log)"
fi
row "rt_checkpoint 256 MiB moved A -> B -> A (--cuda-movable-memory)" "-" \
    "$(verdict $MOVE_RC); held ${HELD[*]:-?} ms" "${MOVE_NOTE:-moved twice, every round right}"

# --- the table --------------------------------------------------------------
{
    echo "## gpu-check: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1) ($ARCH)"
    echo
    echo "rgpu $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), server on loopback $ADDR, $(date -u +%Y-%m-%dT%H:%MZ)."
    echo "Ratios are rgpu/native: above 1 for time is slower, below 1 for bandwidth or rate is slower."
    echo
    echo "| check | native | rgpu | ratio |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "Total check time: $((SECONDS - START_S)) s. Logs: $WORK/logs."
} | tee "$OUT"
