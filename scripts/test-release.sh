#!/usr/bin/env bash
# Tests a vLLM release between the CI lanes' two (0.28.x-0.31.x install beside the
# same torch; each passed and is supported; rerun one to certify a new commit) with the engine tests that prove losslessness and serving: greedy
# identity, the T > 0 distribution test, seeded requests, HTTP (test.sh's other-end
# lane). Its own venv, .venv-vllm-RELEASE; the plugin's release check is lifted for
# the run (VLLM_TREESPEC_ALLOW_UNTESTED_VLLM=1). A release that passes can join
# versions.SUPPORTED and the README's support matrix, with the commit that passed.
# Not part of CI.
#   bash scripts/test-release.sh RELEASE [PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
release=${1:-}
if ! [[ "$release" =~ ^0\.(28|29|30|31)\.[0-9]+$ ]]; then
    echo "usage: bash scripts/test-release.sh RELEASE [pytest args...]; RELEASE has invalid value '$release'; allowed: 0.28.x to 0.31.x (the supported releases: bash scripts/test.sh)" >&2
    exit 2
fi
shift
if [ $# -eq 0 ]; then
    set -- tests/integration/test_greedy.py tests/integration/test_sampling.py \
        tests/integration/test_seeded.py tests/integration/test_http.py
fi
export VLLM_TREESPEC_VLLM=$release VLLM_TREESPEC_ALLOW_UNTESTED_VLLM=1
start=$SECONDS
status=0
bash scripts/test.sh -p no:cacheprovider "$@" || status=$?
echo "[test-release] vLLM $release, commit $(git rev-parse --short HEAD): exit $status after $((SECONDS - start)) s" >&2
exit $status
