#!/usr/bin/env bash
# The MRV2 lane (docs/mrv2.md): plain vLLM engines on Model Runner V2 under Triton's
# interpreter, checked against V1 on the same target, and eagle3_tree's fixed trees on
# MRV2 checked against plain MRV2 (tests/mrv2/): greedy identity, T > 0 homogeneity
# with its negative controls, seeded requests, refusals. Not part of scripts/test.sh: the
# interpreter makes each engine cost minutes on 2 cores. Arguments go to pytest, e.g.
# `bash scripts/test-mrv2.sh -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup-env.sh
TREESPEC_MRV2=1 exec python -m pytest tests/mrv2 "$@"
