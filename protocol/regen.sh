#!/usr/bin/env bash
# Regenerates src/generated/ from schema/*.capnp. Needs Debian's `capnp` and
# `capnpc-rust` (cargo install capnpc --version 0.27.0 --locked).
# `regen.sh --check` fails if the committed code is not what the schemas give.
set -euo pipefail
cd "$(dirname "$0")"
out=src/generated
if [ "${1:-}" = "--check" ]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
capnp compile -orust:"$out" --src-prefix=schema schema/*.capnp
if [ "${1:-}" = "--check" ]; then
    for f in "$out"/*.rs; do
        if ! cmp -s "$f" "src/generated/$(basename "$f")"; then
            echo "protocol/src/generated/$(basename "$f") is stale: run protocol/regen.sh" >&2
            exit 1
        fi
    done
    echo "protocol/src/generated is fresh"
fi
