"""The MRV2 tree slice's vLLM-free parts (``vllm_glue/mrv2``) on MRV2-shaped inputs:
the dynamic tree grown from the roots by the level loop and handed over as MRV2's
drafts, the step read from an input batch, tree acceptance where MRV2's
rejection sampler sits, the tree positions and rows from the model-state wrapper, and
the commit. The engine runs are in tests/mrv2/test_tree_greedy.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.vllm_glue.mrv2.checks import check_mrv2_tree
from vllm_treespec.vllm_glue.mrv2.model_state import TreeModelState
from vllm_treespec.vllm_glue.mrv2.sampler import TreeRejectionSampler
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps
from vllm_treespec.vllm_glue.mrv2.trees import grow_trees, level_step, tree_drafts

V = 50


CFG = TreeSpecConfig.from_dict({"adaptive": False, "copy_branches": 0, "num_nodes": 5,
                                 "depth": 3, "top_k": 2})


class LawDrafter:
    """An ``engine.levels.LevelForwards`` whose hidden state is the one-hot of its
    input token and whose next-token law is a table: after the root 0, token 1 is
    likelier than 2, but 2's best child (5) beats every child of 1, so a dynamic
    tree expands the sibling 2, which a best-path chain plus siblings never does."""

    device = torch.device("cpu")
    max_model_len = 64

    def __init__(self, token_offset: int = 0):
        self.token_offset = token_offset  # target id - draft id (a token map's shift)
        law = torch.full((8, 8), 1e-3)
        for t, nxt in {0: {1: 0.5, 2: 0.45}, 1: {3: 0.6, 4: 0.3}, 2: {5: 0.9, 6: 0.05},
                       3: {7: 0.9}, 4: {7: 0.9}, 5: {7: 0.9}, 6: {7: 0.9}, 7: {0: 0.9}}.items():
            for u, p in nxt.items():
                law[t, u] = p
        self.log_law = (law / law.sum(1, keepdim=True)).log()
        self.positions: list[list[int]] = []

    def draft_vocab_logprobs(self, hidden):
        return hidden @ self.log_law

    def side_level(self, step, width, side_offset, side_mask, *, input_ids, positions,
                   hidden_states):
        self.positions.append(positions.tolist())
        hidden = torch.nn.functional.one_hot(input_ids.long() - self.token_offset, 8).float()
        return hidden, hidden


def test_trees_grow_level_by_level_from_the_roots_and_become_mrv2_drafts():
    drafter = LawDrafter()
    roots = torch.tensor([0, 0])
    hidden = torch.nn.functional.one_hot(roots, 8).float()
    # Request 1's new root sits at 20 (its rejected drafts beyond): its levels too.
    step = level_step(CFG, torch.tensor([10, 20]), torch.zeros(2, 3, dtype=torch.long))
    assert (step.width, step.depth, step.max_prefix, step.side_capacity) == (2, 3, 20, 4)
    trees = grow_trees(CFG, drafter, drafter.draft_vocab_logprobs(hidden),
                       hidden.unsqueeze(1), step, roots, CFG.num_nodes)
    assert drafter.positions == [[10, 10, 20, 20], [11, 11, 21, 21]]  # P' + depth - 1
    drafts, proposed = tree_drafts(trees, 7)
    # BFS: 1 and 2 under the root, then 3 (under 1) and 5 (under the sibling 2),
    # then 7 under 5: the likeliest path goes through the root's second child.
    assert drafts.tolist() == [[1, 2, 3, 5, 7, -1, -1]] * 2
    tree = proposed[1]
    assert tree.tokens == [1, 2, 3, 5, 7] and tree.parents == [0, 0, 1, 2, 4]
    path = drafter.log_law[0, 2] + drafter.log_law[2, 5]
    assert tree.probs[3] == pytest.approx(float(path.exp()))  # the path's probability


def test_a_token_map_turns_draft_ids_into_target_ids():
    drafter = LawDrafter(token_offset=100)
    roots = torch.tensor([0])
    hidden = torch.nn.functional.one_hot(roots, 8).float()
    trees = grow_trees(CFG, drafter, drafter.draft_vocab_logprobs(hidden),
                       hidden.unsqueeze(1), level_step(CFG, torch.tensor([4]),
                                                       torch.zeros(1, 1, dtype=torch.long)),
                       roots, CFG.num_nodes, token_map=torch.arange(8) + 100)
    # The levels forward target ids, as the drafter's embedding expects them.
    assert tree_drafts(trees, 5)[0].tolist() == [[101, 102, 103, 105, 107]]


def _batch(trees_tokens, parents, prefix_lens):
    """An MRV2 ``InputBatch`` of decode requests, request b verifying root + drafts."""
    ids, qsl, cu, pos = [], [0], [0], []
    for toks, p in zip(trees_tokens, prefix_lens):
        ids += toks
        qsl.append(qsl[-1] + len(toks))
        cu.append(cu[-1] + len(toks))
        pos += list(range(p, p + len(toks)))
    n = np.array([len(t) - 1 for t in trees_tokens], dtype=np.int32)
    return SimpleNamespace(
        num_reqs=len(trees_tokens), num_draft_tokens=int(n.sum()), num_draft_tokens_per_req=n,
        idx_mapping_np=np.array([5, 2][:len(trees_tokens)]), query_start_loc_np=np.array(qsl),
        cu_num_logits_np=np.array(cu), input_ids=torch.tensor(ids),
        positions=torch.tensor(pos), num_tokens=len(ids))


def _steps_with(batch, proposed):
    steps = TreeSteps(move_kv=lambda src, dst: None)
    steps.proposed.update(proposed)
    steps.begin(batch, torch.zeros(batch.num_reqs, 4, dtype=torch.long), 16)
    return steps


def _proposed(tokens, parents):
    from vllm_treespec.tree.proposed import ProposedTree

    return ProposedTree(tokens, parents, [0.0] * len(tokens))


def test_acceptance_replaces_the_rejection_samplers_rows():
    # Request 0 (state 5): root 1, nodes a=2 (d1), b=3 (d1), c=4 (child of a).
    # The target's argmax: root -> 3 (the sibling), at b -> 7: accepted [3], bonus 7.
    # Request 1 (state 2): a chain 8 -> 9, argmax root -> 8, at 8 -> 9, at 9 -> 6.
    batch = _batch([[1, 2, 3, 4], [7, 8, 9]], [0, 0], [10, 20])
    steps = _steps_with(batch, {5: _proposed([2, 3, 4], [0, 0, 1]),
                                2: _proposed([8, 9], [0, 1])})
    assert steps.counters["branching_steps"] == 1
    logits = torch.full((7, V), -1.0)
    for row, tok in [(0, 3), (1, 0), (2, 7), (3, 0), (4, 8), (5, 9), (6, 6)]:
        logits[row, tok] = 1.0
    stock = SimpleNamespace(sampled_token_ids=torch.zeros(2, 4, dtype=torch.int64),
                            num_sampled=torch.ones(2, dtype=torch.int32),
                            num_rejected=torch.zeros(2, dtype=torch.int32))
    states = SimpleNamespace(temperature=SimpleNamespace(np=np.zeros(8, np.float32)),
                             top_k=SimpleNamespace(np=np.full(8, V)), vocab_size=V,
                             top_p=SimpleNamespace(np=np.ones(8, np.float32)),
                             min_p=SimpleNamespace(np=np.zeros(8, np.float32)),
                             seeds_set=np.zeros(8, bool), num_logprobs=np.full(8, -1))
    sampler = SimpleNamespace(sampling_states=states,
                              penalties_state=SimpleNamespace(use_penalty=np.zeros(8, bool)))
    seen = []
    out = TreeRejectionSampler(lambda lg, ib, dl, *a: seen.append(lg) or stock, sampler,
                               steps)(logits, batch, None, None)
    assert seen[0] is not logits  # vLLM's sampler gets a copy: it may edit its logits
    assert out.sampled_token_ids.tolist() == [[3, 7, -1, -1], [8, 9, 6, -1]]
    assert out.num_sampled.tolist() == [2, 3]
    assert out.num_rejected.tolist() == [2, 0]

    # The commit moves the accepted node b (row 2) to the first draft slot (row 1).
    hidden = torch.arange(7.0).unsqueeze(1)
    moved = []
    steps.move_kv = lambda src, dst: moved.append((src.tolist(), dst.tolist()))
    steps.commit(batch, hidden, [hidden.clone()])
    assert batch.input_ids.tolist()[:4] == [1, 3, 3, 4]
    assert hidden[:4, 0].tolist() == [0.0, 2.0, 2.0, 3.0]
    assert moved == [([[0, 12]], [[0, 11]])]  # (block, offset): position 12 -> 11
    assert steps.step is None


def test_refused_sampling_parameters_are_named():
    batch = _batch([[1, 2, 3]], [0], [4])
    steps = _steps_with(batch, {5: _proposed([2, 3], [0, 0])})
    states = SimpleNamespace(temperature=SimpleNamespace(np=np.zeros(8, np.float32)),
                             min_p=SimpleNamespace(np=np.zeros(8, np.float32)),
                             seeds_set=np.zeros(8, bool), num_logprobs=np.full(8, -1))
    states.num_logprobs[5] = 2
    sampler = SimpleNamespace(sampling_states=states, penalties_state=None)
    with pytest.raises(NotImplementedError, match="logprobs"):
        TreeRejectionSampler(lambda *a: None, sampler, steps).tree_sampling(batch, steps.step)


def test_model_state_gives_tree_positions_and_rows_to_target_layers_only():
    batch = _batch([[1, 2, 3, 4]], [0], [10])
    steps = TreeSteps(move_kv=None)
    steps.proposed[5] = _proposed([2, 3, 4], [0, 0, 1])
    shared = SimpleNamespace(name="group")
    inner = SimpleNamespace(prepare_attn=lambda *a, **k: {"t.0": shared, "t.1": shared,
                                                          "d.0": shared},
                            prepare_inputs=lambda ib, rs: {}, other=7)
    state = TreeModelState(inner, steps, {"d.0"}, lambda: 16)
    md = state.prepare_attn(batch, None, (torch.zeros(1, 4, dtype=torch.long),), None,
                            None, None)
    assert md["d.0"] is shared and not hasattr(shared, "tree_verify")
    assert md["t.0"] is md["t.1"] and md["t.0"].tree_verify.rows.tolist() == [0, 1, 2, 3]
    assert state.prepare_inputs(batch, None)["positions"].tolist() == [10, 11, 11, 12]
    assert batch.positions.tolist() == [10, 11, 12, 13]  # slots and the drafter: linear
    assert state.other == 7


def test_drafts_that_are_not_the_proposed_tree_are_verified_as_a_chain():
    batch = _batch([[1, 2, 9]], [0], [4])
    steps = _steps_with(batch, {5: _proposed([2, 3], [0, 0])})
    assert steps.step.proposed[0].parents == [0, 1]
    assert steps.counters["branching_steps"] == 0


def test_mrv2_serves_fixed_trees_only(monkeypatch):
    fixed = {"adaptive": False, "copy_branches": 0, "num_nodes": 8, "depth": 4, "top_k": 2}
    monkeypatch.delenv("VLLM_TREESPEC_MRV2_PREVIEW", raising=False)
    with pytest.raises(TreeSpecConfigError, match="VLLM_TREESPEC_MRV2_PREVIEW=1"):
        check_mrv2_tree(TreeSpecConfig.from_dict(fixed))  # a preview, asked for by name
    monkeypatch.setenv("VLLM_TREESPEC_MRV2_PREVIEW", "1")
    check_mrv2_tree(TreeSpecConfig.from_dict(fixed))
    refused = [({"copy_branches": 0}, "adaptive"),
               (dict(fixed, num_nodes=9), "num_nodes"),
               (dict(fixed, copy_branches=2), "copy branches"),
               (dict(fixed, draft="parallel"), "'draft'"),
               (dict(fixed, choices=[[0], [1], [0, 0]]), "choices")]
    for cfg, name in refused:
        with pytest.raises(TreeSpecConfigError, match=name):
            check_mrv2_tree(TreeSpecConfig.from_dict(cfg))
