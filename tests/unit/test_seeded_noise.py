"""Plain and tree steps give a seeded request the same noise for a position.

vLLM's sampler draws a seeded row's Exp(1) noise from the request's generator;
the runner seats that generator on (seed, position) before every step, and tree
steps accept with ``_position_noise`` of the same key. Here vLLM's own
``random_sample`` runs on seated generators and must pick what the tree rule's
noise picks, for every position; a generator left as a stream does not.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.ops.topk_topp_sampler import random_sample

from vllm_treespec.tree import position_samples
from vllm_treespec.vllm_glue.tree_sampler import _position_noise, seat_position_generators

VOCAB = 257


def plain_step_tokens(probs: torch.Tensor, seeds: dict[int, int], positions: list[int],
                      seat: bool) -> list[int]:
    """One plain step per position, rows sampled by vLLM's sampler op."""
    generators = {b: torch.Generator().manual_seed(s) for b, s in seeds.items()}
    out = []
    for pos in positions:
        if seat:
            seat_position_generators(generators, seeds, [pos] * len(seeds))
        out.append(random_sample(probs.clone(), generators).tolist())
    return out


def test_a_plain_step_draws_the_noise_a_tree_step_draws_for_its_position():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(2, VOCAB), dim=-1)     # flat enough to vary
    seeds, positions = {0: 7, 1: 8}, [40, 41, 42, 43, 44, 45]
    plain = plain_step_tokens(probs, seeds, positions, seat=True)
    for b, seed in seeds.items():
        noise = _position_noise(seed, positions[0], len(positions), VOCAB, torch.device("cpu"))
        depth = torch.arange(len(positions)).unsqueeze(0)   # one node per position
        node_probs = probs[b].expand(1, len(positions), VOCAB)
        tree = position_samples(node_probs, depth, noise.unsqueeze(0))[0].tolist()
        assert [row[b] for row in plain] == tree
    # Negative control: a stream generator (stock vLLM) picks other tokens.
    streamed = plain_step_tokens(probs, seeds, positions, seat=False)
    assert sum(s != p for s, p in zip(streamed, plain)) >= len(positions) // 2
