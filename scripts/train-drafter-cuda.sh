#!/usr/bin/env bash
# The drafter's CUDA recipe (vllm_treespec/train/cuda_recipe.py; docs/drafter.md "Training the
# drafter on a GPU"):
#   here, with vLLM:     scripts/train-drafter-cuda.sh pack .drafter-pack
#   on the GPU machine:  scripts/train-drafter-cuda.sh run .drafter-pack --out DIR
# `run` collects the GGUF parts that arrived (each delivery may hold only some), and
# once all are there trains for at most --minutes (default 8); rerun it to continue.
# With --out-part-mib N the head's weights come out in parts; here:
#   scripts/train-drafter-cuda.sh join-head DIR   rejoins them, checked by hash.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m vllm_treespec.train.cuda_recipe "$@"
