"""A one-wide tree (``top_k=1``, ``num_nodes = depth = k``, adaptive off) drafts
exactly what stock vLLM ``eagle3`` with ``k`` speculative tokens drafts; so does
the adaptive budget's chain mode at depth ``k`` from a wide tree configuration.

Same drafter, same greedy requests one at a time: if every proposal is the same,
vLLM's own spec-decode counters agree to the token: as many draft tokens, and as
many accepted at each position (with the shipped drafter, hundreds of them).
Copy branches are off (``copy_branches`` 0): stock ``eagle3`` has none.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine, run_engine

pytestmark = pytest.mark.vllm

K = 3


def test_one_wide_tree_drafts_what_stock_eagle3_drafts(target_dir, tokenizer, engine_dir):
    from tests.integration.prompts import chat_token_ids
    from vllm_treespec.assets import committed_drafter_dir

    drafter = str(committed_drafter_dir())
    prompts = chat_token_ids(tokenizer)[:4]
    runs = {}
    for name, spec, schedule in (
            ("stock", {"method": "eagle3", "model": drafter, "num_speculative_tokens": K},
             None),
            ("one_wide", {"method": "eagle3_tree", "model": drafter, "top_k": 1,
                          "num_nodes": K, "depth": K, "adaptive": False, "copy_branches": 0}, None),
            # The adaptive budget held in chain mode at depth K, every step.
            ("chain_mode", {"method": "eagle3_tree", "model": drafter, "top_k": 4,
                            "num_nodes": 8, "depth": K, "copy_branches": 0},
             {"off_steps": 0, "period": 1, "mode": "defer", "chain": True})):
        runs[name] = run_engine({"engine": base_engine(target_dir, speculative_config=spec,
                                                       max_num_seqs=1),
                                 "prompts": prompts, "batch": 1, "schedule": schedule,
                                 "sampling": {"temperature": 0.0, "max_tokens": 64}},
                                engine_dir, f"one_wide_{name}")
    stock = runs["stock"]
    for name in ("one_wide", "chain_mode"):
        tree = runs[name]
        assert tree["outputs"] == stock["outputs"], name
        spec = dict(tree["spec_decode"])
        # vLLM sizes the per-position counter by the draft slots (num_nodes).
        tail = spec["accepted_per_pos"][K:]
        assert not any(tail), (name, tail)
        spec["accepted_per_pos"] = spec["accepted_per_pos"][:K]
        assert spec == stock["spec_decode"], (name, spec, stock["spec_decode"])
    chains = runs["chain_mode"]["tree"]
    assert chains["chain_steps"] == chains["steps"] > 0, chains
    accepted = stock["spec_decode"]["accepted_per_pos"]
    assert len(accepted) == K and accepted[0] >= 20 and accepted[1] > 0, accepted
