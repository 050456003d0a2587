#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment with relaytrain and what its
# tests need. Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  # On a machine without a GPU take the CPU build; never pull a multi-GB CUDA build there.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.8"
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
"$VPY" -m pip install -q -e ".[dev,storage]"
