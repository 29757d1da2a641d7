"""A drafter that raises costs that step its drafts, never a request or the engine.

Every fourth forward of the shipped drafter raises (first passes, tree levels and
catch-up passes alike). The engine must finish every request with exactly plain
vLLM's greedy output, count the faults, and keep verifying trees on the steps
that did draft.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import SHORT_GREEDY_TOKENS, base_engine, run_engine

pytestmark = pytest.mark.vllm


def test_drafting_faults_fall_back_to_plain_steps(target_dir, short_greedy_reference,
                                                  engine_dir):
    from vllm_treespec.assets import committed_drafter_dir

    prompts, plain = short_greedy_reference
    tree = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "num_nodes": 8,
            "depth": 3, "top_k": 4, "adaptive": False}
    out = run_engine({"engine": base_engine(target_dir, speculative_config=tree),
                      "prompts": prompts, "draft_faults": 4,
                      "sampling": {"temperature": 0.0, "max_tokens": SHORT_GREEDY_TOKENS}},
                     engine_dir, "draft_faults")
    assert out["outputs"] == plain["outputs"]
    metrics = out["tree"]
    assert metrics["draft_faults"] >= 5, metrics
    assert metrics["trees"] >= 5, metrics  # steps between the faults still speculate
    # The real builder on the shipped head (no oracle): its trees are accepted.
    assert metrics["mean_accept_len"] >= 1.5, metrics
    assert metrics["unmatched_trees"] == 0, metrics  # every scheduled tree the proposed one
    log = (engine_dir / "draft_faults.log").read_text()
    warnings = log.count("eagle3_tree: drafting failed")
    assert 1 <= warnings <= 1 + out["seconds"] / 60, warnings  # at most once a minute
