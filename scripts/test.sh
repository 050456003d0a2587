#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. This is what CI runs (.ci/run).
#
# Two test processes: one leaves a core idle about a third of the time (Ray runs wait on
# workers starting, storage tests on their servers), two finish in about two thirds of the time
# (measured on this project's 2-core host; docs/MEASURED.md). Each takes whole files, so a
# module's fixtures (a Ray cluster, a reference run) are made once. Recovery tests read from the
# recovery's own record that no phase waited for a timeout, with deadlines that leave room for a
# loaded host: they run beside the others (docs/MEASURED.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is a cache in the project's own .venv: each module compiled once, when first imported,
# not in every process that imports it (PYTHONDONTWRITEBYTECODE, where set, would).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/ruff check src tests
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
# A test process that dies (a timeout's forced exit) ends the pass: xdist's replacement process
# once left the file scheduler waiting forever on the dead one's files.
# The slowest tests are listed at the end: what to look at when the suite nears its budget.
exec "${PYTEST[@]}" -n 2 --dist loadfile --max-worker-restart=0 --durations=40 -m "not soak" "$@"
