"""`vllm-treespec npu-check`'s end-to-end verdict and its report, judged on the CPU.

The verdict logic (:func:`vllm_treespec.commands.npu_e2e.judge`) is fed made-up run
results here; nothing runs on an NPU or serves a model, so this shows only that
the check can fail the way it must, not that the NPU path passes it.
"""

from vllm_treespec.commands import npu_check, npu_e2e

BRANCHING = {"trees": 40, "steps": 20, "chain_steps": 5, "mean_tree_size": 9.5,
             "mean_accept_len": 2.4}


def _judge(plain, tree, summary):
    report = npu_check.Report()
    npu_e2e.judge(report, plain, tree, summary, {"plain": 10.0, "eagle3_tree": 20.0})
    return {c["name"]: c["status"] for c in report.checks}, report


def test_branching_trees_with_plain_decodings_tokens_pass():
    status, report = _judge([[1, 2], [3]], [[1, 2], [3]], BRANCHING)
    assert status == {"e2e/trees_verified": "PASS", "e2e/greedy_identity": "PASS",
                      "e2e/speed": "PASS"}
    assert report.ok


def test_a_run_that_verified_no_branching_tree_fails():
    for summary in (None, {**BRANCHING, "trees": 0}, {**BRANCHING, "chain_steps": 20},
                    {**BRANCHING, "mean_tree_size": 1.0}):
        status, report = _judge([[1]], [[1]], summary)
        assert status["e2e/trees_verified"] == "FAIL", summary
        assert not report.ok


def test_a_token_that_differs_from_plain_decoding_fails():
    status, _ = _judge([[1, 2], [3, 4]], [[1, 2], [3, 5]], BRANCHING)
    assert status["e2e/greedy_identity"] == "FAIL"
    status, _ = _judge([[1, 2], [3]], [[1, 2]], BRANCHING)  # a prompt lost
    assert status["e2e/greedy_identity"] == "FAIL"


def test_the_e2e_run_uses_a_fixed_tree_in_float32():
    args = npu_check._parser().parse_args(["--e2e-model", "t", "--e2e-drafter", "d"])
    assert args.e2e_dtype == "float32"
    spec = npu_e2e.tree_spec(args)
    assert spec["method"] == "eagle3_tree" and spec["adaptive"] is False
    assert (spec["num_nodes"], spec["depth"], spec["top_k"]) == (32, 6, 8)


def test_the_verdict_table_has_one_row_per_check():
    _, report = _judge([[1]], [[2]], BRANCHING)
    table = report.verdict_table("device npu:0, float32").splitlines()
    assert table[0] == "npu-check verdict: FAIL (device npu:0, float32)"
    rows = [line for line in table if line.startswith("| e2e/")]
    assert len(rows) == len(report.checks) == 3
    assert "| e2e/greedy_identity | FAIL | yes |" in rows[1]
