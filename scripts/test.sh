#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. This is what CI runs (.ci/run).
#
# Two test processes: one leaves a core idle about a third of the time (Ray runs wait on
# workers starting, storage tests on their servers), two finish in about two thirds of the time
# (measured on this project's 2-core host; docs/MEASURED.md). Each takes whole files, so a
# module's fixtures (a Ray cluster, a reference run) are made once. Tests whose deadline is
# close to their own work (marker `alone`) then run by themselves, so another test's load never
# eats into it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
status=0
# A test process that dies (a timeout's forced exit) ends the pass: xdist's replacement process
# once left the file scheduler waiting forever on the dead one's files.
# The slowest tests are listed at the end: what to look at when the suite nears its budget.
"${PYTEST[@]}" -n 2 --dist loadfile --max-worker-restart=0 --durations=40 \
  -m "not soak and not alone" "$@" \
  || status=$?
# exit code 5: nothing selected (e.g. a file given with no such test in it)
"${PYTEST[@]}" -m "alone and not soak" "$@" || { rc=$?; [ "$rc" = 5 ] || status=$rc; }
[ "$status" = 5 ] && status=0
exit "$status"
