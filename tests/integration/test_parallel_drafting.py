"""``"draft": "parallel"``: trees from one parallel-drafting forward.

A head with parallel-drafting slots (here the shipped head given slots and a
stand-in state, so depth 1 drafts well and deeper slots are its own untrained
guesses) runs in stock vLLM ``eagle3`` with ``"parallel_drafting": true`` and
in ``eagle3_tree``. A one-wide parallel tree (``top_k=1``, ``num_nodes = depth
= K``) is the argmax of each depth's marginal, which is what stock vLLM
proposes: the same draft tokens at every step (recorded on both sides: deeper
slots are rarely accepted by this head, so only the drafts themselves show a
slot at the wrong position, a wrong mask or a wrong stand-in state), the same
outputs (plain vLLM's) and the same spec-decode counters. A branching parallel
tree is greedy identical to plain vLLM too.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import base_engine, run_engine

pytestmark = pytest.mark.vllm

K = 3


@pytest.fixture(scope="module")
def parallel_head(target_dir, tmp_path_factory):
    from vllm_treespec.assets import committed_drafter_dir
    from vllm_treespec.train.model import Eagle3Drafter
    from vllm_treespec.train.target_weights import load_target_head

    _, embed, _, _ = load_target_head(str(target_dir))
    head = Eagle3Drafter.load_checkpoint(committed_drafter_dir(), embed_weight=embed)
    state = torch.randn(head.fc.in_features, generator=torch.Generator().manual_seed(0))
    head.enable_parallel(pard_token=0, slots=K, init_state=state)
    return head.save_checkpoint(tmp_path_factory.mktemp("parallel_head"), dtype=torch.float32)


def test_one_wide_parallel_tree_drafts_what_stock_parallel_drafting_drafts(
        target_dir, engine_dir, parallel_head, greedy_reference):
    model = str(parallel_head)
    prompts, plain = greedy_reference
    prompts, plain = prompts[:3], [[o[:48]] for o in plain[:3]]  # plain vLLM, 48 tokens
    runs = {}
    for name, spec in (
            ("stock", {"method": "eagle3", "model": model, "num_speculative_tokens": K,
                       "parallel_drafting": True}),
            ("one_wide", {"method": "eagle3_tree", "model": model, "draft": "parallel",
                          "top_k": 1, "num_nodes": K, "depth": K, "adaptive": False}),
            ("tree", {"method": "eagle3_tree", "model": model, "draft": "parallel",
                      "top_k": 4, "num_nodes": 8, "depth": K, "adaptive": False})):
        # The three requests batched: slots of requests with different prefix lengths
        # share one forward (greedy: both engines schedule the same batches).
        runs[name] = run_engine({"engine": base_engine(target_dir, speculative_config=spec,
                                                       max_num_seqs=3),
                                 "prompts": prompts, "record_proposals": True,
                                 "sampling": {"temperature": 0.0, "max_tokens": 48}},
                                engine_dir, f"parallel_{name}")
    stock, one_wide, tree = runs["stock"], runs["one_wide"], runs["tree"]
    assert len(stock["proposals"]) > 80
    assert one_wide["proposals"] == stock["proposals"]
    assert stock["outputs"] == one_wide["outputs"] == tree["outputs"] == plain
    spec = dict(one_wide["spec_decode"])
    assert not any(spec["accepted_per_pos"][K:])  # vLLM sizes it by the node budget
    spec["accepted_per_pos"] = spec["accepted_per_pos"][:K]
    assert spec == stock["spec_decode"], (spec, stock["spec_decode"])
    accepted = stock["spec_decode"]["accepted_per_pos"]
    assert accepted[0] >= 15, accepted
    assert tree["tree"]["mean_tree_size"] > K, tree["tree"]  # branching trees
