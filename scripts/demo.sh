#!/usr/bin/env bash
# The main job on a fresh machine: set up, prepare the built-in corpus (the Python standard
# library's source, BPE-tokenized), train a small Olmo 3 on CPU with held-out evaluation and
# checkpoints, then plot and audit the run. A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is a cache in the project's own .venv: each module compiled once, when first imported,
# not in every process that imports it (PYTHONDONTWRITEBYTECODE, where set, would).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
R=.venv/bin/relaytrain
if [ ! -f data/demo/index.json ]; then
  "$R" data prepare --demo --tokenizer bpe:4096 --out data/demo
fi
rm -rf runs/demo  # the demo always starts fresh; `relaytrain train` on a run dir resumes it
"$R" train configs/demo.yaml "$@"
"$R" plot runs/demo --out runs/demo/loss.png >/dev/null
"$R" data audit runs/demo
echo
echo "metrics:     runs/demo/metrics.jsonl"
echo "checkpoints: runs/demo/checkpoints/"
echo "loss plot:   runs/demo/loss.png"
