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
# pip would compile the bytecode of every file it installs (2 GB of packages, most of them never
# imported); the end of this script compiles what relaytrain imports. (Bytecode must be written
# here: with PYTHONDONTWRITEBYTECODE set, imports would compile from source every time.)
PIP=("$VPY" -m pip install -q --no-compile)
if ! "$VPY" -c "import torch" 2>/dev/null; then
  # On a machine without a GPU take the CPU build; never pull a multi-GB CUDA build there.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.8"
  else
    "${PIP[@]}" "torch==2.13.0"
  fi
fi
# The rest through uv: it installs the same releases as pip in seconds where pip takes over a
# minute. torch is pinned to the build just installed, so uv never swaps in another (a CUDA
# build is GBs). Where uv cannot be had or fails, pip does it all.
pin=.venv/torch-pin.txt
"$VPY" -c "from importlib.metadata import version; print('torch==' + version('torch'))" >"$pin"
if ! { "${PIP[@]}" "uv>=0.5" 2>/dev/null &&
       "$VPY" -m uv pip install -q --python "$VPY" --constraint "$pin" -e ".[dev,storage]"; }; then
  "${PIP[@]}" --constraint "$pin" -e ".[dev,storage]"
fi
# Every relaytrain module imported once, writing bytecode: what its processes import (torch, Ray,
# ...) starts from compiled files; 28 s against 76 s for all of site-packages (docs/MEASURED.md).
# scripts/test.sh and demo.sh write the bytecode of anything imported later as it is first used.
env -u PYTHONDONTWRITEBYTECODE "$VPY" -c '
import importlib, pkgutil, relaytrain
for m in pkgutil.walk_packages(relaytrain.__path__, "relaytrain."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)'
