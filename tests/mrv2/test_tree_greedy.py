"""``eagle3_tree`` on Model Runner V2 (MRV2) under Triton's interpreter: fixed trees,
greedy, decode exactly as plain MRV2 does, at batch 1 and with three concurrent
prompts, and the trees are verified as trees (branching verify steps, counted by the
runner), and their levels draft vLLM's own greedy chain along the likeliest path.
Negative controls: without the accepted path's commit, or with the tree rows'
rotary positions left linear, the output diverges: both are what keep it right.

Run with ``bash scripts/test-mrv2.sh``; skipped otherwise (harness.GATE).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine
from tests.mrv2 import harness

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not harness.enabled(),
                       reason="MRV2 under Triton's interpreter: bash scripts/test-mrv2.sh"),
    pytest.mark.skipif(not harness.has_mrv2(), reason="this vLLM has no MRV2 CPU runner"),
]

MAX_TOKENS = 16
TREE_RUNNER = "vllm_treespec.vllm_glue.mrv2.runner.TreeMRV2CPUModelRunner"
# A fixed-size dynamic tree: 4 levels of the top-2 frontier, reranked to 8 nodes
# (vllm_glue/mrv2/trees.py).
TREE = {"method": "eagle3_tree", "num_nodes": 8, "depth": 4, "top_k": 2,
        "adaptive": False, "copy_branches": 0}


def _spec(target_dir, prompts, tree: dict | None = None, **extra) -> dict:
    engine = base_engine(target_dir)
    if tree is not None:
        from vllm_treespec.assets import committed_drafter_dir

        engine["speculative_config"] = dict(tree, model=str(committed_drafter_dir()))
    return {"engine": engine, "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS}, **extra}


@pytest.fixture(scope="module")
def plain_mrv2(target_dir, chat_prompts, tmp_path_factory) -> dict:
    return harness.run_engine(_spec(target_dir, chat_prompts),
                              tmp_path_factory.mktemp("plain"), "plain-v2", "v2")


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_tree_mrv2_greedy_equals_plain_mrv2(target_dir, chat_prompts, plain_mrv2, tmp_path,
                                            num_prompts):
    out = harness.run_engine(_spec(target_dir, chat_prompts[:num_prompts], TREE), tmp_path,
                             "tree-v2", "v2", module="tests.mrv2.tree_engine")
    log = (tmp_path / "tree-v2.log").read_text()
    assert (out["runner"], out["runner_mro"][2]) == (TREE_RUNNER, harness.V2_RUNNER)
    assert "Using V2 Model Runner" in log and "eagle3_tree: Model Runner V2" in log
    assert [len(o) for o in out["outputs"]] == [MAX_TOKENS] * num_prompts
    assert out["outputs"] == plain_mrv2["outputs"][:num_prompts]
    counters = out["counters"]
    # Every drafting step verified a branching tree, one per request it drafted for.
    assert counters["branching_steps"] == counters["verify_steps"] > 0
    assert counters["verified_trees"] >= counters["verify_steps"]
    print(f"\n{num_prompts} prompt(s): tree generate {out['seconds']:.1f} s, plain "
          f"(3 prompts) {plain_mrv2['seconds']:.1f} s, counters {counters}")


def test_tree_mrv2_levels_draft_vllms_own_chain(target_dir, chat_prompts, tmp_path):
    # The greedy path of each dynamic tree (its levels: side-buffer attention over
    # the paged prefix) against vLLM's stock chain drafting (paged decode steps).
    out = harness.run_engine(_spec(target_dir, chat_prompts[:1], TREE, check_chain=True),
                             tmp_path, "chain", "v2", module="tests.mrv2.tree_engine")
    counters = out["counters"]
    assert counters["chain_checked"] >= counters["verify_steps"] > 0
    assert counters["chain_level_nodes"] >= counters["chain_checked"]  # levels checked too
    assert counters["chain_mismatch"] == 0, counters
    print(f"\nchain control: {counters}")


@pytest.mark.parametrize("control", ["skip_commit", "linear_positions"])
def test_tree_mrv2_without_the_commit_or_tree_positions_diverges(
        target_dir, chat_prompts, plain_mrv2, tmp_path, control):
    out = harness.run_engine(_spec(target_dir, chat_prompts, TREE, **{control: True}),
                             tmp_path, control, "v2", module="tests.mrv2.tree_engine")
    assert out["counters"]["branching_steps"] > 0
    assert out["outputs"] != plain_mrv2["outputs"]
