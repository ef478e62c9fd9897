#!/usr/bin/env bash
# Runs fuzz targets under libFuzzer, each for a bounded time, from the
# committed seed corpus; exits non-zero if one crashes, times out or runs
# out of memory (the input is then in fuzz/artifacts/TARGET/). Needs the
# nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz --locked`).
#
#   bash fuzz/run.sh [SECONDS] [TARGET...]    # default: 30 s, every target
#   bash fuzz/run.sh --ci                       # what CI runs, below
#
# `--ci` runs a fixed number of inputs per target from a fixed seed, so a
# run is the same on every machine: CI checks that nothing the fuzzer
# reaches from the seed corpus within that budget crashes (a regression
# shows at once) without failing a submission because a fuzzer that ran
# longer, or on a faster machine, met an older bug. Finding new bugs is
# for the longer timed runs (docs/security.md, "Fuzzing").
#
# New inputs the fuzzer finds go to fuzz/work/TARGET/ (not committed), so a
# later run goes on from them. A crash becomes a regression: fix it, copy
# the artifact to fuzz/regressions/TARGET/ (replayed by `cargo test -p
# rgpu-fuzz-targets`) and add a test in the owning crate.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A ci_runs=([frame]=20000000 [session]=120000 [capnp_msg]=30000 [module]=300000 [ptx]=200000 [token]=3000000 [snapshot]=300000)
ci=0
if [ "${1:-}" = "--ci" ]; then
    ci=1
    shift
    secs=120
else
    secs=${1:-30}
    shift || true
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame session capnp_msg module ptx token snapshot)
# The instrumented build: no sanitizer (safe Rust; the run is several times
# faster without ASan), debug assertions and overflow checks on, so an
# arithmetic overflow is found as a panic.
flags=(--sanitizer none --debug-assertions)
cargo +nightly fuzz build "${flags[@]}"
mkdir -p fuzz/work
for t in "${targets[@]}"; do
    mkdir -p "fuzz/work/$t" "fuzz/artifacts/$t"
    log="fuzz/work/$t.log"
    bound=(-max_total_time="$secs")
    if [ "$ci" = 1 ]; then
        # A fresh work directory: the same inputs every time.
        rm -rf "fuzz/work/$t" && mkdir -p "fuzz/work/$t"
        bound+=(-seed=1 -runs="${ci_runs[$t]}")
        echo "== $t: ${ci_runs[$t]} inputs from seed 1 (at most ${secs}s)"
    else
        echo "== $t: ${secs}s"
    fi
    status=0
    cargo +nightly fuzz run "${flags[@]}" "$t" "fuzz/work/$t" "fuzz/corpus/$t" -- \
        "${bound[@]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1 || status=$?
    grep -E '^#[0-9]+[[:space:]]*DONE|^stat::(number_of_executed_units|peak_rss_mb)|^INFO: seed corpus' "$log" || true
    if [ "$status" -ne 0 ]; then
        # (without cargo-fuzz's dump of the input as a byte list)
        grep -v '^[[:space:]]*\[' "$log" | tail -40 >&2
        echo "fuzz target $t failed (exit $status): the input is in fuzz/artifacts/$t/, the log in $log" >&2
        exit 1
    fi
done
