#!/usr/bin/env bash
# The demo command (README): sets up .venv if needed, prepares the embedded
# SmolLM2-135M target and its drafter, then runs `vllm-treespec demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
exec vllm-treespec demo "$@"
