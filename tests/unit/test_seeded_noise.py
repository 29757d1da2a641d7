"""Plain and tree steps give a seeded request the same sample at a position.

vLLM's sampler op (``Sampler.topk_topp_sampler``: on 0.27.1 Exp(1) noise drawn from
the request's generator, on 0.32.0's CPU a seed drawn from it for a fused
Gumbel-max kernel) samples a plain step's rows; the runner seats each seeded
request's generator on (seed, position) before every step, and tree steps draw
each position with the same op on a generator seated the same way
(``seeded_draw``). Here a batch of plain steps through the installed vLLM's op
must pick, row by row, what the tree rule picks for every position; a generator
left as a stream (stock vLLM) does not.
"""

from __future__ import annotations

import torch

from vllm_treespec.vllm_glue.seeded_draws import (plain_step_sampler, seat_position_generators,
                                                  seeded_draw)

VOCAB = 257


def plain_step_tokens(logits: torch.Tensor, k, p, seeds: dict[int, int], positions: list[int],
                      seat: bool) -> list[list[int]]:
    """One plain step per position, the whole batch through vLLM's sampler op."""
    op = plain_step_sampler(None)
    generators = {b: torch.Generator().manual_seed(s) for b, s in seeds.items()}
    out = []
    for pos in positions:
        if seat:
            seat_position_generators(generators, seeds, [pos] * len(seeds))
        tokens, _ = op(logits.clone(), generators, k, p)
        out.append(tokens.view(-1).tolist())
    return out


def test_a_plain_step_draws_what_a_tree_step_draws_for_its_position():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) / 2                          # flat enough to vary
    k = torch.tensor([VOCAB, 40, VOCAB])
    p = torch.tensor([1.0, 1.0, 0.9])
    seeds, positions = {0: 7, 1: 8, 2: 9}, [40, 41, 42, 43, 44, 45]
    plain = plain_step_tokens(logits, k, p, seeds, positions, seat=True)
    op = plain_step_sampler(None)
    for b, seed in seeds.items():
        tree = [seeded_draw(op, logits[b], k[b], p[b], seed, pos) for pos in positions]
        assert [row[b] for row in plain] == tree
    assert len({tuple(row) for row in plain}) > 1  # the draws vary with the position
    # Negative control: a stream generator (stock vLLM) picks other tokens.
    streamed = plain_step_tokens(logits, k, p, seeds, positions, seat=False)
    assert sum(s != t for s, t in zip(streamed, plain)) >= len(positions) // 2


def test_position_seeds_are_a_fixed_digest_not_pythons_hash_of_a_tuple():
    """A seeded request's text must not hang on CPython's tuple hash (its algorithm
    changed in 3.8 and may again); the old seeds were ``hash((seed, index))``."""
    from vllm_treespec.vllm_glue.seeded_draws import position_seed

    pinned = {(0, 0): 7120306904099482837, (1234, 17): 2128133252485127613,
              (-5, 3): 289003891355039093}
    assert {pair: position_seed(*pair) for pair in pinned} == pinned
    assert all(position_seed(*pair) != hash(pair) & (2**63 - 1) for pair in pinned)
    seeds = {position_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000 and all(0 <= x < 2**63 for x in seeds)
