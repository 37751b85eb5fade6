#!/usr/bin/env bash
# The test suite on a fresh machine: set-up, then every test. GPU tests skip without a GPU
# (KILN_REQUIRE_GPU=1 makes a missing GPU a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
cargo test "$@"
