#!/usr/bin/env bash
# Set-up shared by the README's commands: a project-local Python environment (.venv) with NVRTC
# from PyPI (the nvidia-cuda-nvrtc wheel). Idempotent: a second run installs nothing.
# A CUDA toolkit's NVRTC, where there is one, is still preferred by kiln's discovery.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust from rustup.rs" >&2; exit 1; }
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1; then
  echo "setup: installing NVRTC (nvidia-cuda-nvrtc) into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc
fi
# NVRTC 12 as well: CUDA 13's NVRTC no longer compiles for Volta (sm_70, sm_72), and the tests
# compile every spec for those with it (kiln itself uses it only through KILN_NVRTC_LIB).
if ! .venv/bin/python -m pip show -q nvidia-cuda-nvrtc-cu12 >/dev/null 2>&1; then
  echo "setup: installing NVRTC 12 (nvidia-cuda-nvrtc-cu12) into .venv, for Volta" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc-cu12
fi
