#!/usr/bin/env bash
# The test command of the README: installs the CUDA toolchain the
# end-to-end tests compile with (PyPI wheels, cached), builds everything,
# and runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash integration/setup-cuda.sh
cargo build --release --locked
cargo test --release --locked
