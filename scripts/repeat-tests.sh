#!/usr/bin/env bash
# Runs tests N times in a row and prints how many runs passed: for tests whose
# outcome could depend on the machine's timing (docs/reliability.md, "Tests that
# read a measured time"). Not part of CI.
#   bash scripts/repeat-tests.sh N                 # the timing-dependent tests
#   bash scripts/repeat-tests.sh N PYTEST_ARGS...  # any others, e.g. a whole module
# Each run's output goes to repeat-runs/run-I.log; VLLM_TREESPEC_VLLM picks the release.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! [[ "${1:-}" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: bash scripts/repeat-tests.sh N [pytest args...]  (N: runs, 1 or more)" >&2
    exit 2
fi
runs=$1
shift
if [ $# -eq 0 ]; then
    set -- tests/integration/test_greedy.py::test_adaptive_budget_turns_off_useless_speculation \
        "tests/integration/test_tensor_parallel.py::test_tp2_tree_server_answers_as_the_tp2_plain_server[adaptive]" \
        tests/integration/test_tensor_parallel.py::test_a_slow_rank_plans_the_same_depths \
        tests/integration/test_parallel_drafting.py \
        tests/integration/test_data_parallel.py \
        tests/integration/test_http.py::test_tree_metrics_on_prometheus_endpoint \
        tests/integration/test_http.py::test_worker_returns_free_heap_when_the_engine_idles \
        tests/integration/test_metrics_api_servers.py \
        tests/integration/test_drafter_faults.py
fi
mkdir -p repeat-runs
passed=0
for i in $(seq 1 "$runs"); do
    if bash scripts/test.sh -p no:cacheprovider "$@" > "repeat-runs/run-$i.log" 2>&1; then
        passed=$((passed + 1))
        echo "run $i: passed"
    else
        echo "run $i: FAILED ($(grep -E '^(FAILED|ERROR) ' "repeat-runs/run-$i.log" | head -3 | tr '\n' ' '))"
    fi
done
echo "$passed of $runs runs passed"
[ "$passed" -eq "$runs" ]
