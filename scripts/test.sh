#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
