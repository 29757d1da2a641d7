"""Seeded requests' randomness, the same on plain and tree steps.

A seeded request must reproduce whatever the adaptive budget decides, and that
is timing-dependent. So every sequence position of a seeded request draws from
a generator seated at that position (``position_seed``): plain steps through
vLLM's sampler (``seat_position_generators`` before each step), tree steps by
calling the same op of vLLM's for the nodes their walk reaches
(``seeded_draws``; ``tree_sampler`` walks the tree).
"""

from __future__ import annotations

import hashlib

import torch


def position_seed(seed: int, index: int) -> int:
    """Generator seed of sequence position ``index`` of a request seeded ``seed``:
    a fixed digest of the pair (Python's ``hash`` of a tuple is CPython's to
    change between releases, and a seeded request must reproduce on any)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seat_position_generators(generators: dict[int, torch.Generator],
                             seeds: dict[int, int], next_index) -> None:
    """Reseed each seeded row's generator for the position it samples next.

    vLLM's sampler draws a seeded row's randomness from the request's generator,
    a stream advanced once per plain step; tree steps draw per position
    (``seeded_draws``). Keyed by position on every step, the draw of a position
    is the same whether a plain step or a tree step samples it, so a seeded
    request reproduces whatever the adaptive budget decides (off steps
    included). next_index[b]: the sequence index of row b's next token."""
    for b, gen in generators.items():
        if b in seeds:
            gen.manual_seed(position_seed(seeds[b], int(next_index[b])))


def plain_step_sampler(sampler):
    """vLLM's op that samples a plain step's rows from their processed logits and
    generators (``Sampler.topk_topp_sampler``): its draw for a seeded row is what
    tree steps reproduce, whatever the release (0.27.1: Exp(1) noise from the
    generator; 0.32.0 on the CPU: a seed from it for a fused Gumbel-max kernel)."""
    if sampler is not None:
        return sampler.topk_topp_sampler
    import vllm._custom_ops  # noqa: F401 -- loads the kernels the op may call
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    return TopKTopPSampler()


def seeded_draws(op, x: torch.Tensor, k, p, seeds: list[int],
                  indices: list[int]) -> torch.Tensor:
    """[n] the tokens vLLM's sampler op draws for rows ``x`` [n, V] (after
    temperature, with their top-k / top-p [n]) of requests seeded ``seeds`` at
    sequence ``indices``: one call, each row on its own generator seated there,
    as a plain step draws its seeded rows (each row's draw depends on its
    generator alone: ``tests/unit/test_seeded_noise.py``)."""
    gens = {j: torch.Generator(device=x.device).manual_seed(position_seed(s, i))
            for j, (s, i) in enumerate(zip(seeds, indices))}
    tokens, _ = op(x.clone(), gens, k, p)
    return tokens.view(-1)


def seeded_draw(op, x: torch.Tensor, k, p, seed: int, index: int) -> int:
    """``seeded_draws`` of one row ``x`` [V] (k, p: scalars or None)."""
    return int(seeded_draws(op, x.unsqueeze(0), None if k is None else k.view(1),
                            None if p is None else p.view(1), [seed], [index])[0])
