#!/usr/bin/env bash
# Set-up shared by the README's commands: a project-local Python environment (.venv) with NVRTC
# from PyPI (the nvidia-cuda-nvrtc wheel). Idempotent: a second run installs nothing.
# A CUDA toolkit's NVRTC, where there is one, is still preferred by kiln's discovery.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust from rustup.rs" >&2; exit 1; }
[ -x .venv/bin/python ] || python3 -m venv .venv
# The driver's CUDA version (nvidia-smi's header, "CUDA Version: 12.4"), if there is a driver:
# NVRTC 13's output does not load on a CUDA 12 driver, so such a machine gets NVRTC 12 only.
driver_cuda=""
if command -v nvidia-smi >/dev/null 2>&1; then
  driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\.\([0-9]*\).*/\1.\2/p' | head -n1 || true)
fi
driver_major=${driver_cuda%%.*}
if [ -n "$driver_major" ] && [ "$driver_major" -lt 13 ]; then
  if [ "$driver_major" -lt 12 ]; then
    echo "setup: the driver supports CUDA $driver_cuda; kiln needs a CUDA 12 or 13 driver" >&2
    exit 1
  fi
  echo "setup: CUDA $driver_cuda driver: NVRTC 12 (nvidia-cuda-nvrtc-cu12) only" >&2
  if .venv/bin/python -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1; then
    echo "setup: note: .venv also has NVRTC 13 (nvidia-cuda-nvrtc), whose output this driver cannot load; remove it with: .venv/bin/python -m pip uninstall nvidia-cuda-nvrtc" >&2
  fi
elif ! .venv/bin/python -m pip show -q nvidia-cuda-nvrtc >/dev/null 2>&1; then
  echo "setup: installing NVRTC (nvidia-cuda-nvrtc) into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc
fi
# NVRTC 12 as well: the NVRTC of CUDA 12 drivers, and CUDA 13's NVRTC no longer compiles for Volta
# (sm_70, sm_72); the tests compile every spec for those with it.
if ! .venv/bin/python -m pip show -q nvidia-cuda-nvrtc-cu12 >/dev/null 2>&1; then
  echo "setup: installing NVRTC 12 (nvidia-cuda-nvrtc-cu12) into .venv, for Volta" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc-cu12
fi
