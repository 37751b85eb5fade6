#!/usr/bin/env bash
# The test suite on a fresh machine: set-up, then every test, then one line with the totals.
# GPU tests skip without a GPU (KILN_REQUIRE_GPU=1 makes a missing GPU a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test "$@" 2>&1 | tee "$log" || status=$?
# cargo prints one "test result:" line per test binary; add them up.
awk '/^test result:/ { for (i = 2; i <= NF; i++) { if ($i == "passed;") p += $(i-1); if ($i == "failed;") f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit $status
