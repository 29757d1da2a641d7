"""A static tree (Medusa-style ``choices``) end to end: the shipped drafter fills
a fixed topology every step, the target verifies it under the tree mask, and the
greedy output is plain vLLM's, with drafts accepted below the first level."""

from __future__ import annotations

import pytest

from tests.integration.conftest import SHORT_GREEDY_TOKENS, base_engine, run_engine

pytestmark = pytest.mark.vllm

# Two children of the root, the best one expanded twice more, a side branch.
CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_a_static_tree_is_greedy_identical_to_plain_decoding(target_dir, short_greedy_reference,
                                                            engine_dir):
    from vllm_treespec.assets import committed_drafter_dir

    prompts, plain = short_greedy_reference
    tree = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "choices": CHOICES,
            "adaptive": False}
    out = run_engine({"engine": base_engine(target_dir, speculative_config=tree),
                      "prompts": prompts,
                      "sampling": {"temperature": 0.0, "max_tokens": SHORT_GREEDY_TOKENS}},
                     engine_dir, "static_choices")
    assert out["outputs"] == plain["outputs"]
    metrics = out["tree"]
    assert metrics["trees"] > 0, metrics
    assert metrics["mean_tree_size"] <= len(CHOICES), metrics
    depth = metrics["per_depth_acceptance"]
    assert len(depth) >= 2 and depth[1] > 0, metrics  # paths through the fixed tree accepted
