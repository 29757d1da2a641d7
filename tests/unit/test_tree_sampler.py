"""The tree sampler: its greedy fast path (argmax of the raw logit rows) against
the general path; nodes processed on demand against every node processed first;
penalties against vLLM's op; logprobs from the rows that emitted the tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm_treespec.tree import TreeBatch, greedy_accept  # noqa: E402
from vllm_treespec.engine import accept as engine_accept  # noqa: E402
from vllm_treespec.engine.accept import NodeLogits, node_probs, row_argmax, scaled  # noqa: E402
from vllm_treespec.engine.step import VerifyStep, node_rows  # noqa: E402
from vllm_treespec.vllm_glue.tree_sampler import sample_with_trees, tree_sampling  # noqa: E402

V = 16


def _step_and_logits(dtype: torch.dtype):
    # Request 0: root -> 1, 2, 3; 1 -> 4 (4 drafts). Request 1: root -> 5; 5 -> 6
    # (2 drafts, one padding node in a tree of 5).
    tree = TreeBatch.from_parents([[9, 1, 2, 3, 4], [9, 5, 6]],
                                  [[0, 0, 0, 0, 1], [0, 0, 1]], tree_size=5, max_children=3)
    step = VerifyStep(req_index=torch.tensor([0, 1]), tree=tree,
                      prefix_len=torch.tensor([10, 20]), token_start=torch.tensor([0, 5]),
                      logit_start=torch.tensor([0, 5]), num_reqs=2)
    spec_md = SimpleNamespace(num_draft_tokens=[4, 2], cu_num_sampled_tokens=torch.tensor([5, 8]))
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    logits[0, 1] = logits[1, 4] = logits[4, 11] = 9.0  # request 0 accepts 1 -> 4, then 11
    logits[5, 5] = logits[6, 12] = 9.0                  # request 1 accepts 5, then rejects 6
    return step, spec_md, logits.to(dtype)


def _metadata(mask: torch.Tensor | None):
    return SimpleNamespace(all_greedy=True, max_num_logprobs=None, no_penalties=True,
                           allowed_token_ids_mask=mask, temperature=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_the_processed_path(dtype):
    step, spec_md, logits = _step_and_logits(dtype)
    fast, fast_acc = sample_with_trees(None, logits, spec_md, _metadata(None), step, {})
    # An allowed-token mask that masks nothing sends the same batch the general way.
    slow, slow_acc = sample_with_trees(None, logits, spec_md,
                                       _metadata(torch.zeros(2, V, dtype=torch.bool)), step, {})
    assert fast.sampled_token_ids.tolist() == slow.sampled_token_ids.tolist()
    assert torch.equal(fast_acc.path, slow_acc.path)
    assert fast.sampled_token_ids.tolist() == [[1, 4, 11], [5, 12, -1]]
    assert fast_acc.num_accepted.tolist() == [2, 1]


@given(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]),
                min_size=12, max_size=12),
       st.integers(1, 4))
def test_row_argmax_equals_torch_argmax(values, rows):
    """Ties (the first maximum), infinities and NaN (the maximum) as torch."""
    x = torch.tensor(values * rows, dtype=torch.float32).view(rows, -1)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert torch.equal(row_argmax(x.t().contiguous().t()), x.argmax(-1))  # strided: torch's


def test_node_probs_on_demand_equal_the_whole_tree_computation():
    """Asked for (tree, node) pairs in any order, ``node_probs`` returns what
    temperature, top-k and top-p over every node of every tree give at once."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    step, _, logits = _step_and_logits(torch.float32)
    Bt, T = step.tree.batch_size, step.tree.tree_size
    processed = torch.randn(Bt, T, V, generator=torch.Generator().manual_seed(1))
    md = SimpleNamespace(temperature=torch.tensor([0.7, 1.3]), top_k=torch.tensor([5, V]),
                         top_p=torch.tensor([1.0, 0.8]))
    x = processed / md.temperature.view(Bt, 1, 1)
    whole = torch.softmax(apply_top_k_top_p(x.reshape(Bt * T, V), md.top_k.repeat_interleave(T),
                                            md.top_p.repeat_interleave(T)), -1).view(Bt, T, V)
    rows, nodes = torch.tensor([1, 0, 0, 1, 1]), torch.tensor([2, 4, 0, 0, 3])
    got = node_probs(processed, step, md, rows, nodes)
    torch.testing.assert_close(got, whole[rows, nodes], rtol=0, atol=0)
    assert int((got[0] > 0).sum()) < V and int((got[1] > 0).sum()) <= 5  # top-p / top-k cut


def test_sampled_batch_of_trees_skips_vllms_sampler():
    """At T > 0 a batch whose every request carries a tree (and asks no logprobs)
    takes all its tokens from the trees: vLLM's sampler (None here) is not
    called, which would sort the vocabulary for top-p once more per request."""
    step, spec_md, logits = _step_and_logits(torch.float32)
    md = SimpleNamespace(all_greedy=False, max_num_logprobs=None, no_penalties=True,
                         allowed_token_ids_mask=None, temperature=torch.tensor([0.7, 0.0]),
                         top_k=None, top_p=torch.tensor([0.9, 1.0]))
    out, acc = sample_with_trees(None, logits, spec_md, md, step, {})
    assert out.sampled_token_ids[1].tolist() == [5, 12, -1]  # the greedy request, as greedy
    emitted = out.sampled_token_ids[0, : int(acc.num_accepted[0]) + 1]
    assert bool((emitted >= 0).all())  # accepted drafts and a bonus token, no padding


def _counting_node_probs(monkeypatch):
    """Record the (tree row, node) pairs the sampler asks distributions for."""
    asked = []

    def counting(processed, step, md, rows, nodes, **kwargs):
        asked.extend(zip(rows.tolist(), nodes.tolist()))
        return node_probs(processed, step, md, rows, nodes, **kwargs)

    monkeypatch.setattr(engine_accept, "node_probs", counting)
    return asked


def _sampled_md(temperature):
    return SimpleNamespace(all_greedy=False, max_num_logprobs=None, no_penalties=True,
                           allowed_token_ids_mask=None, temperature=torch.tensor(temperature),
                           top_k=None, top_p=torch.tensor([0.9, 0.9]))


def test_a_mixed_batch_walks_only_its_sampled_trees(monkeypatch):
    """Greedy trees in a sampled step take the argmax result; none of their
    nodes is asked for a distribution (a top-p sort each, thrown away before)."""
    asked = _counting_node_probs(monkeypatch)
    step, spec_md, logits = _step_and_logits(torch.float32)
    out, acc = sample_with_trees(None, logits, spec_md, _sampled_md([0.0, 0.7]), step, {})
    assert out.sampled_token_ids[0].tolist() == [1, 4, 11]  # the greedy request, as greedy
    assert asked and {row for row, _ in asked} == {1}
    assert {node for _, node in asked} == set(acc.path[1].tolist())


def test_a_seeded_tree_reads_only_its_path_and_accepts_as_every_node_sampled(monkeypatch):
    from vllm_treespec.vllm_glue import tree_sampler
    from vllm_treespec.bench.tree_reference import processed_node_logits
    from vllm_treespec.vllm_glue.seeded_draws import plain_step_sampler, seeded_draw

    drawn = []
    real = tree_sampler.seeded_draws

    def counting(op, x, k, p, seeds, indices):
        drawn.extend(indices)
        return real(op, x, k, p, seeds, indices)

    monkeypatch.setattr(tree_sampler, "seeded_draws", counting)
    step, spec_md, logits = _step_and_logits(torch.float32)
    md = _sampled_md([0.7, 1.0])
    logits[:5] /= 4  # flat enough that the draws decide
    # A seed whose draws accept a path below the root, so the check below bites
    # (which seeds do depends on the release's sampler op).
    for seed in range(1234, 1264):
        drawn.clear()
        out, acc = sample_with_trees(None, logits, spec_md, md, step, {0: seed})
        if int(acc.num_accepted[0]) >= 1:
            break
    assert int(acc.num_accepted[0]) >= 1
    assert len(drawn) == int(acc.num_accepted[0]) + 1  # one draw per node of the path
    # Every node of tree 0 drawn by vLLM's sampler op at its position: same tokens.
    processed = processed_node_logits(logits, step, md)
    op = plain_step_sampler(None)
    tree = step.tree.take(torch.tensor([0]))
    every = torch.full_like(tree.token, -1)
    for node in range(int(tree.node_counts[0]) + 1):
        x, k, p = scaled(processed[0, node].unsqueeze(0), md, step.req_index[:1])
        every[0, node] = seeded_draw(op, x[0], None if k is None else k[0],
                                      None if p is None else p[0], seed,
                                      11 + int(tree.depth[0, node]))
    assert acc.tokens[0].tolist() == greedy_accept(tree, every).tokens[0].tolist()


def test_seeded_trees_batched_draw_what_each_node_drawn_alone_draws():
    """Two seeded trees: each depth's draws go to vLLM's op in one call, and each
    tree accepts what the op, called for every node on its own, picks."""
    from vllm_treespec.bench.tree_reference import processed_node_logits
    from vllm_treespec.vllm_glue.seeded_draws import plain_step_sampler, seeded_draw

    step, spec_md, logits = _step_and_logits(torch.float32)
    md = _sampled_md([0.7, 1.0])
    logits[:] /= 4
    processed, op = processed_node_logits(logits, step, md), plain_step_sampler(None)
    accepted = 0
    for seeds in ({0: 11, 1: 12}, {0: 13, 1: 14}, {0: 15, 1: 16}, {0: 17, 1: 18}):
        _, acc = sample_with_trees(None, logits, spec_md, md, step, seeds)
        accepted += int(acc.num_accepted.sum())
        for b, seed in seeds.items():
            tree = step.tree.take(torch.tensor([b]))
            every = torch.full_like(tree.token, -1)
            for node in range(int(tree.node_counts[0]) + 1):
                x, k, p = scaled(processed[b, node].unsqueeze(0), md, step.req_index[b:b + 1])
                every[0, node] = seeded_draw(op, x[0], None if k is None else k[0],
                                              None if p is None else p[0], seed,
                                              int(step.prefix_len[b]) + 1
                                              + int(tree.depth[0, node]))
            assert acc.tokens[b].tolist() == greedy_accept(tree, every).tokens[0].tolist()
    assert accepted > 0  # some walk went below a root, so the check bites


def test_a_batch_of_sampled_trees_near_zero_temperature_accepts_the_greedy_paths():
    """Every tree sampled, none seeded (the walk over the whole batch): at a
    temperature where each node's distribution is one token, the walk emits
    what greedy acceptance emits."""
    step, spec_md, logits = _step_and_logits(torch.float32)
    md = _sampled_md([0.01, 0.01])
    out, _ = sample_with_trees(None, logits, spec_md, md, step, {})
    assert out.sampled_token_ids.tolist() == [[1, 4, 11], [5, 12, -1]]


def _vllm_processed(logits, step, md, trees, nodes):
    """Node ``nodes[i]`` of tree ``trees[i]`` through vLLM's own processing: its
    request's allowed-token mask, then ``apply_all_penalties`` with the node's
    output so far (the request's output plus the node's path)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    tree, reqs = step.tree, step.req_index[trees]
    outputs = []
    for i, node in zip(trees.tolist(), nodes.tolist()):
        path = tree.ancestors[i, node, 1: int(tree.depth[i, node]) + 1]
        outputs.append(md.output_token_ids[int(step.req_index[i])] + tree.token[i, path].tolist())
    x = logits[node_rows(step)[trees, nodes]].float()
    if md.allowed_token_ids_mask is not None:
        x = x.masked_fill(md.allowed_token_ids_mask[reqs], float("-inf"))
    return apply_all_penalties(x, md.prompt_token_ids[reqs], md.presence_penalties[reqs],
                               md.frequency_penalties[reqs], md.repetition_penalties[reqs],
                               outputs)


def _penalty_md(repetition, frequency, presence):
    n = len(repetition)
    return SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=False,
        prompt_token_ids=torch.tensor([[3, 7, 11, V], [2, 5, V, V]][:n]),  # V pads
        repetition_penalties=torch.tensor(repetition), frequency_penalties=torch.tensor(frequency),
        presence_penalties=torch.tensor(presence), output_token_ids=[[1, 12, 12], [4]][:n])


@pytest.mark.parametrize("penalised", [[True, False], [False, True], [True, True]])
def test_penalties_touch_only_the_trees_that_set_them_and_equal_every_row_penalised(penalised):
    """Penalties go to the node rows of requests that set one, as vLLM's op gives
    them over all rows: a neutral request's rows (1, 0, 0) come back unchanged."""
    from vllm_treespec.bench.tree_reference import processed_node_logits

    step, _, logits = _step_and_logits(torch.float32)
    logits[:, [3, 7, 12]] = torch.tensor([2.0, -1.5, 0.5])  # both signs on penalised tokens
    md = _penalty_md([1.3 if p else 1.0 for p in penalised], [0.4 if p else 0.0 for p in penalised],
                     [0.6 if p else 0.0 for p in penalised])
    got = processed_node_logits(logits, step, md)
    Bt, T = step.tree.batch_size, step.tree.tree_size
    expected = _vllm_processed(logits, step, md, torch.arange(Bt).repeat_interleave(T),
                               torch.arange(T).repeat(Bt)).view(got.shape)
    assert torch.equal(got, expected)
    raw = logits[node_rows(step)].float()
    for i, p in enumerate(penalised):  # the check bites: penalised rows changed
        assert torch.equal(got[i], raw[i]) != p


class _WholeTable:
    """The reference for ``NodeLogits``: every node of every tree processed up front."""

    def __init__(self, logits, step, sampling):
        self.table = NodeLogits(logits, step, sampling).of_trees()  # the real class, not the patch

    def __getitem__(self, index):
        return self.table[index]

    def of_trees(self, trees=None):
        return self.table if trees is None else self.table[trees]


@pytest.mark.parametrize("temperature,seeds", [([0.0, 0.9], {}), ([0.9, 0.8], {1: 77}),
                                               ([0.0, 0.9], {1: 5}), ([0.9, 0.8], {})])
def test_nodes_processed_on_demand_sample_what_the_whole_table_samples(monkeypatch, temperature,
                                                                       seeds):
    """Penalties and an allowed-token mask applied to the nodes a step reads only
    (greedy trees: all; sampled: their walk's) give the tokens that processing
    every node first gives, for every mix of greedy, sampled and seeded trees."""
    step, spec_md, logits = _step_and_logits(torch.float32)
    logits[:, :8] /= 6  # flat enough that the draws decide
    mask = torch.zeros(2, V, dtype=torch.bool)
    mask[:, 13:] = True
    md = SimpleNamespace(**vars(_penalty_md([1.4, 1.2], [0.3, 0.5], [0.5, 0.0])),
                         all_greedy=False, max_num_logprobs=None,
                         temperature=torch.tensor(temperature), top_k=torch.tensor([V, 6]),
                         top_p=torch.tensor([0.95, 0.9]))
    md.allowed_token_ids_mask = mask
    asked = []
    whole = engine_accept.NodeLogits.__getitem__

    def counting(self, index):
        asked.extend(zip(index[0].tolist(), index[1].tolist()))
        return whole(self, index)

    for draw in range(6):
        torch.manual_seed(draw)
        asked.clear()
        monkeypatch.setattr(engine_accept.NodeLogits, "__getitem__", counting)
        out, acc = sample_with_trees(None, logits, spec_md, md, step, seeds)
        monkeypatch.undo()
        torch.manual_seed(draw)
        monkeypatch.setattr(engine_accept, "NodeLogits", _WholeTable)
        ref, ref_acc = sample_with_trees(None, logits, spec_md, md, step, seeds)
        monkeypatch.undo()
        assert out.sampled_token_ids.tolist() == ref.sampled_token_ids.tolist()
        assert torch.equal(acc.path, ref_acc.path)
        greedy = greedy_accept(step.tree,
                               _WholeTable(logits, step, tree_sampling(md)).table.argmax(-1))
        for i, t in enumerate(temperature):  # sampled trees: their path's nodes only
            nodes = {n for row, n in asked if row == i}
            if t > 0:
                assert nodes == set(acc.path[i].tolist())
            else:
                assert nodes == set(range(step.tree.tree_size))
                assert acc.tokens[i].tolist() == greedy.tokens[i].tolist()


def test_node_logits_of_trees_on_any_batch_rows_equal_vllms_processing():
    """Trees on batch rows 2 and 0 (row 1 decodes without a tree): each node's
    logits are its own request's, masked and penalised as vLLM's op does them."""

    tree = TreeBatch.from_parents([[9, 1, 2, 3, 4], [9, 5, 6]],
                                  [[0, 0, 0, 0, 1], [0, 0, 1]], tree_size=5, max_children=3)
    step = VerifyStep(req_index=torch.tensor([2, 0]), tree=tree,
                      prefix_len=torch.tensor([10, 20]), token_start=torch.tensor([1, 6]),
                      logit_start=torch.tensor([1, 6]), num_reqs=3)
    logits = torch.randn(11, V, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(3, V, dtype=torch.bool)
    mask[2, 14:] = True
    md = SimpleNamespace(
        allowed_token_ids_mask=mask, no_penalties=False,
        prompt_token_ids=torch.tensor([[3, 7, V], [2, 5, 8], [1, 6, V]]),
        repetition_penalties=torch.tensor([1.3, 1.6, 1.0]),
        frequency_penalties=torch.tensor([0.4, 0.1, 0.0]),
        presence_penalties=torch.tensor([0.6, 0.0, 0.0]),
        output_token_ids=[[1, 12, 12], [4, 4], [7]])
    trees, nodes = torch.tensor([1, 0, 0, 1, 0]), torch.tensor([2, 4, 0, 1, 3])
    got = NodeLogits(logits, step, tree_sampling(md))[trees, nodes]
    assert torch.equal(got, _vllm_processed(logits, step, md, trees, nodes))
    assert not torch.equal(got[0], logits[node_rows(step)[1, 2]])  # request 0: penalised
    assert bool(torch.isinf(got[[1, 2, 4]]).any())  # request 2: masked


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs"])
def test_logprobs_come_from_the_node_rows_that_emitted_the_tokens(mode):
    """Each emitted token's logprobs: its node's row, raw or processed as vLLM's
    samplers process it (penalties; a sampled request's temperature, top-k and
    top-p too), as read from the whole table of processed nodes."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    from vllm_treespec.vllm_glue.tree_sampler import _logprobs

    step, _, logits = _step_and_logits(torch.float32)
    md = SimpleNamespace(**vars(_penalty_md([1.5, 1.3], [0.7, 0.4], [0.2, 0.3])),
                         max_num_logprobs=2, temperature=torch.tensor([0.8, 0.0]),
                         top_k=torch.tensor([4, V]), top_p=torch.tensor([0.9, 1.0]))
    table = NodeLogits(logits, step, tree_sampling(md)).of_trees()
    acc = greedy_accept(step.tree, table.argmax(-1))
    width, K1 = acc.tokens.shape[1], 3
    base = SimpleNamespace(logprobs_tensors=(torch.zeros(2, K1, dtype=torch.long),
                                             torch.zeros(2, K1), torch.zeros(2, dtype=torch.long)))
    sampler = Sampler(logprobs_mode=mode)
    got = _logprobs(sampler, logits, NodeLogits(logits, step, tree_sampling(md)), step, md,
                   acc, base, width)
    rows = torch.gather(node_rows(step), 1, acc.path).reshape(-1)
    if mode.startswith("processed"):  # tree 0 sampled: vLLM's temperature, top-k, top-p
        src = table[torch.arange(2).repeat_interleave(width), acc.path.reshape(-1)]
        src[:width] = apply_top_k_top_p(src[:width] / 0.8, torch.full((width,), 4),
                                        torch.full((width,), 0.9))
        assert bool(torch.isinf(src[:width]).any())  # the cut shows in what is compared
    else:
        src = logits[rows]
    if mode.endswith("logprobs"):
        src = src.log_softmax(-1)
    tokens = acc.tokens.reshape(-1).clamp_min(0)
    want = Sampler.gather_logprobs(src, 2, tokens)
    assert torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(got.logprob_token_ids, want.logprob_token_ids)
    if mode.startswith("processed"):  # the processing shows, so the check bites
        raw = Sampler.gather_logprobs(logits[rows].log_softmax(-1), 2, tokens)
        assert not torch.equal(got.logprobs[width:], raw.logprobs[width:])  # penalties
        unscaled = Sampler.gather_logprobs(table[0, acc.path[0]].log_softmax(-1), 2,
                                           tokens[:width])
        assert not torch.equal(got.logprobs[:width], unscaled.logprobs)  # temperature
