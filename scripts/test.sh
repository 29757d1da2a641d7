#!/usr/bin/env bash
# The test command (README): sets up .venv if needed, then runs the whole suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
exec python -m pytest "$@"
