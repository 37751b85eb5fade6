#!/usr/bin/env bash
# kiln's main job on a fresh machine: build, fill the kernel cache for this machine's GPUs (sm_90
# when there is none), then run the self-check on every GPU (skipped without one).
# Extra arguments go to `kiln warm`, e.g. scripts/warm.sh --arch sm_80 --arch sm_90
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --quiet --bin kiln
source .venv/bin/activate
target/release/kiln warm "$@"
target/release/kiln check
