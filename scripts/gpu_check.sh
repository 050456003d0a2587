#!/usr/bin/env bash
# Issue 9's GPU figures in one command on one CUDA GPU (an H200: about 10 minutes):
#   bash scripts/gpu_check.sh [OUT_DIR] [--only SECTION,...]
# Writes OUT_DIR/gpu.json (default $OUT, else runs/gpu-check) after every section and prints
# the whole JSON on the last line. Sections: throughput (1.48B vs HF eager and compiled),
# checkpointing (memory per policy, cost of deterministic algorithms), olmo3_7b (seq 8192, fp32
# master weights), portability (CPU <-> CUDA resume), determinism (exact re-run and resume).
# First, tests/parallel/test_fsdp.py's CUDA test: FSDP2 gathers bf16 under autocast (stderr).
# Uses .venv if there is one, else the python on PATH with src/ importable (no install).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-runs/gpu-check}"
if [[ $# -gt 0 && $1 != --* ]]; then out_dir=$1; shift; fi
py=.venv/bin/python
[[ -x $py ]] || py=python3
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
# Fewer fragmentation failures at the 7B peak; a fixed cuBLAS workspace for exact mode.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
# FSDP2's bf16-gather policy (parallel/fsdp.py) on this GPU, in seconds; to stderr, so the
# JSON stays the last line of stdout, and never in place of the bench.
"$py" -m pytest -q -p no:cacheprovider tests/parallel/test_fsdp.py -k cuda >&2 \
  || echo "gpu_check: the FSDP2 precision-policy check failed (above)" >&2
exec "$py" -m relaytrain.cli bench gpu --device cuda --out "$out_dir" --json "$@"
