"""Seeded requests' draws on MRV2: the noise plain MRV2 samples a position with.

MRV2 samples every request by Gumbel-max over its processed logits, the noise keyed
by (the request's seed, the position of the token whose logits are drawn from):
``vllm/v1/worker/gpu/sample/gumbel.py``, ``Sampler._sample_random``. A seeded request
on a tree step draws each depth's sample with the same kernel and the same keys, so
its output is a function of the seed alone, as on plain MRV2, whatever trees were
drafted (``engine.accept.seeded_acceptance`` walks the path those samples choose)."""

from __future__ import annotations

import torch

from vllm_treespec.engine.accept import SeededDraw


def gumbel_draw(use_fp64: bool) -> SeededDraw:
    """``engine.accept``'s seeded draw with MRV2's Gumbel kernel. The engine hands
    rows after temperature and the sequence index of the token drawn; MRV2 keys a
    draw by the position of the row's own token, one less."""

    def draw(x: torch.Tensor, top_k, top_p, seeds: list[int],
             indices: list[int]) -> torch.Tensor:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
        from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

        n, dev = x.shape[0], x.device
        # As Sampler.sample: temperature already applied, then top-k / top-p, then
        # the noised argmax (apply_temperature=False: the kernel reads the
        # temperature only to tell a sampled row from a greedy one).
        x = apply_top_k_top_p(x.float().clone(), top_k, top_p)
        rows = torch.arange(n, dtype=torch.int32, device=dev)  # each row its own state
        return gumbel_sample(
            x.contiguous(), rows, torch.ones(n, dtype=torch.float32, device=dev),
            torch.tensor(seeds, dtype=torch.int64, device=dev),
            torch.tensor([i - 1 for i in indices], dtype=torch.int64, device=dev),
            apply_temperature=False, is_drafting=False, use_fp64=use_fp64)

    return draw
