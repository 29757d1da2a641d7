"""Time the Triton tree-attention kernel (``vllm_treespec.kernels``) on a device.

On a CUDA GPU, per shape (B requests, tree of T nodes, committed prefix P; heads
of a Llama-8B layer: 32 query heads, 8 KV heads, head size 128; bf16; paged KV
with block size 16), median of CUDA-event timings:

* ``tree``: the kernel on the trees (random branching shapes);
* ``chain``: the same kernel on chains of T (its causal path, no bit tests);
* ``sdpa_causal``: the floor a causal decode kernel sets: torch SDPA (flash)
  over the same KV, pre-gathered dense, without a mask (T queries x P+T keys);
* ``sdpa_mask``: dense-mask SDPA (what a framework without a tree kernel does),
  on the same pre-gathered KV with a [B, 1, T, P+T] boolean mask.

Pre-gathering flatters both SDPA baselines (the kernel reads the paged cache).
Also the bitmask metadata for B=64, M=64 on the CPU (target: <= 1 ms).

    python -m vllm_treespec.bench.tree_attention_kernel --out tree_attention_kernel.json

Without a CUDA device it runs one tiny shape under Triton's CPU interpreter (a
correctness smoke check: interpreter timings mean nothing) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

HAS_CUDA = torch.cuda.is_available()


def _kernel():
    """``tree_attention`` and ``tree_row_metadata``; without CUDA under Triton's CPU
    interpreter, which must be chosen before the kernel module is first imported."""
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_treespec.kernels.tree_attention import tree_attention, tree_row_metadata

    return tree_attention, tree_row_metadata


def random_tree_mask(rng: random.Random, B: int, T: int) -> torch.Tensor:
    """[B, T, T] ancestor-or-self masks; node i's parent is one of the 4 nodes
    before it (bushy, topological)."""
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            if i:
                parent = rng.randrange(max(0, i - 4), i)
                mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask


def make_case(B: int, T: int, P: int, H: int, KVH: int, D: int, dtype, dev,
              block_size: int = 16, seed: int = 0):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L = P + T
    nblk = (L + block_size - 1) // block_size
    perm = torch.randperm(B * nblk, generator=gen)
    block_table = perm.view(B, nblk).to(torch.int32).to(dev)
    k_cache = torch.randn(B * nblk, block_size, KVH, D, generator=gen).to(dtype).to(dev)
    v_cache = torch.randn(B * nblk, block_size, KVH, D, generator=gen).to(dtype).to(dev)
    q = torch.randn(B * T, H, D, generator=gen).to(dtype).to(dev)
    mask = random_tree_mask(rng, B, T).to(dev)
    qsl = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
    seq = torch.full((B,), L, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, block_table, qsl, seq, mask


def _dense(k_cache, block_table, B, L):
    """Paged -> [B, KVH, L, D] contiguous (the SDPA baselines' input)."""
    bs = k_cache.shape[1]
    pos = torch.arange(L, device=k_cache.device)
    blocks = block_table[:, pos // bs].long()
    return k_cache[blocks, pos % bs].permute(0, 2, 1, 3).contiguous()


def cuda_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_shape(B: int, T: int, P: int, H=32, KVH=8, D=128, dtype=torch.bfloat16) -> dict:
    tree_attention, tree_row_metadata = _kernel()
    dev = "cuda"
    scale = D ** -0.5
    q, kc, vc, bt, qsl, seq, mask = make_case(B, T, P, H, KVH, D, dtype, dev)
    rows = tree_row_metadata(qsl, seq, mask)
    chain_rows = tree_row_metadata(qsl, seq)  # causal rows: the kernel without bit tests
    L = P + T
    k = _dense(kc, bt, B, L).repeat_interleave(H // KVH, dim=1)
    v = _dense(vc, bt, B, L).repeat_interleave(H // KVH, dim=1)
    qd = q.view(B, T, H, D).transpose(1, 2)
    full = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=dev), mask], dim=2)
    out = torch.empty_like(q)
    F = torch.nn.functional
    r = {"B": B, "T": T, "P": P,
         "tree_ms": cuda_ms(lambda: tree_attention(q, kc, vc, bt, 16, rows, scale, out=out)),
         "chain_ms": cuda_ms(lambda: tree_attention(q, kc, vc, bt, 16, chain_rows, scale,
                                                    out=out)),
         "sdpa_causal_ms": cuda_ms(lambda: F.scaled_dot_product_attention(qd, k, v,
                                                                          scale=scale)),
         "sdpa_mask_ms": cuda_ms(lambda: F.scaled_dot_product_attention(
             qd, k, v, attn_mask=full.unsqueeze(1), scale=scale))}
    r["tree_vs_causal"] = round(r["tree_ms"] / r["sdpa_causal_ms"], 3)
    r["mask_vs_tree"] = round(r["sdpa_mask_ms"] / r["tree_ms"], 3)
    return r


def metadata_ms(B: int = 64, M: int = 64, repeats: int = 100) -> float:
    """CPU time to build the per-row bitmask metadata of a B x (1 + M) step, warm
    (as every step after the first: the first calls pay for fresh allocations)."""
    _, tree_row_metadata = _kernel()
    T = M + 1
    mask = random_tree_mask(random.Random(0), B, T)
    qsl = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    seq = torch.full((B,), 1024 + T, dtype=torch.int32)
    for _ in range(20):
        tree_row_metadata(qsl, seq, mask)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        tree_row_metadata(qsl, seq, mask)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tree_attention, tree_row_metadata = _kernel()
    result = {"metadata_ms_B64_M64_cpu": round(metadata_ms(), 3)}
    if HAS_CUDA:
        result["device"] = torch.cuda.get_device_name()
        result["shapes"] = [bench_shape(B, T, P) for B in (1, 16, 64) for T in (8, 32, 64)
                            for P in (512, 4096)]
    else:
        from vllm_treespec.attention import PagedTreeAttentionMetadata, paged_tree_attention

        q, kc, vc, bt, qsl, seq, mask = make_case(2, 5, 21, 4, 2, 16, torch.float32, "cpu",
                                                  block_size=4)
        got = tree_attention(q, kc, vc, bt, 4, tree_row_metadata(qsl, seq, mask), 0.25)
        ref = paged_tree_attention(q, kc, vc, PagedTreeAttentionMetadata(
            qsl, seq, bt, 4, tree_mask=mask), 0.25)
        result["device"] = "cpu (Triton interpreter): no timings; they need a GPU or NPU"
        result["interpreter_max_abs_err"] = float((got - ref).abs().max())
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
