#!/usr/bin/env bash
# The test command of the README: installs the CUDA toolchain the
# end-to-end tests compile with (PyPI wheels, cached), builds everything,
# runs every test of the workspace, then CuPy and numba-cuda checks through
# rgpu (docs/compatibility.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash integration/setup-cuda.sh
cargo build --release --locked
cargo test --release --locked
# Real libraries (CuPy, numba-cuda; pinned, cached in ~/.cache/rgpu/libs-venv)
# through rgpu on the sim.
bash integration/libraries/run.sh
