"""Per-layer time of CPU tree attention next to vLLM's native causal kernel.

For a verify step of B requests, each with a committed prefix of P tokens and a
tree of T nodes (root included), this times one attention layer three ways on
the same paged cache (SmolLM2-135M's shapes: 9 query / 3 KV heads, head 64,
block size 128, fp32):

- ``native``: vLLM's CPU kernel, causal over the linear layout (what a chain
  step costs; wrong for a branching tree);
- ``chains``: the tree verified as causal chain requests of the same native
  kernel (``chain_split``): copies of the prefix's tail block into spare blocks,
  the paths' K/V written there, one kernel call (what every layer of a branching
  verify step pays when the runner reserved spare blocks, the default);
- ``tree``: ``cpu_layout.tree_attention`` with its per-step plan built once
  (the fallback for a step that needs more spare blocks than reserved);
- ``plan``: building the chain split, once per step (shared by all layers).

Every call writes to the same few blocks here, which stay in the CPU's caches;
in a served step each layer's spare blocks are cold, so there ``chains`` costs
more (measured in a step: 0.08-0.09 ms against 0.11-0.12 for ``tree``).

    python -m vllm_treespec.bench.cpu_tree_attention [--threads 2] [--out FILE.json]

Prints a markdown table; ``tree / native`` is the ratio to get near 1. A
branching verify step runs ``tree`` in every layer instead of ``native`` (the
native kernel is skipped when every request of the step has a tree).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from vllm_treespec.attention import PagedTreeAttentionMetadata, cpu_layout
from vllm_treespec.attention.chain_split import split_into_chains
from vllm_treespec.tree import TreeBatch, tree_mask

H, KVH, D, BLOCK = 9, 3, 64, 128


def random_trees(B: int, T: int, gen: torch.Generator) -> TreeBatch:
    """Trees of T nodes whose parents are drawn among the previous nodes (BFS-like)."""
    parents = []
    for _ in range(B):
        par = [0]
        for i in range(1, T):
            par.append(int(torch.randint(0, i, (1,), generator=gen)) if i > 1 else 0)
        parents.append(par)
    tokens = [[1] * T for _ in range(B)]
    return TreeBatch.from_parents(tokens, parents, tree_size=T, max_children=T)


def setup(B: int, T: int, P: int, gen: torch.Generator):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, BLOCK, D, "auto")
    seq = P + T
    nblk = -(-seq // BLOCK)
    spare = 2 * B * T  # past the requests' blocks; enough for any split of these trees
    cache = torch.randn(B * nblk + 1 + spare, KVH, BLOCK, 2 * D, generator=gen)
    block_table = torch.randperm(B * nblk, generator=gen).view(B, nblk).int()
    q_lens = torch.full((B,), T, dtype=torch.int32)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.full((B,), seq, dtype=torch.int32)
    query = torch.randn(B * T, H, D, generator=gen)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=B, num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    key_cache, value_cache = cache.view(cache.shape[0], KVH, 2 * BLOCK, D).chunk(2, dim=2)
    out = torch.empty_like(query)

    def native():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=D ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
            scheduler_metadata=sched, s_aux=None)
        return out

    trees = random_trees(B, T, gen)
    meta = PagedTreeAttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens,
                                      block_table=block_table, block_size=BLOCK,
                                      tree_mask=tree_mask(trees), max_query_len=T,
                                      max_seq_len=seq)

    p = cpu_layout.plan(meta, torch.float32)

    def tree():
        return cpu_layout.tree_attention(query, cache, p, D ** -0.5)

    spare_ids = list(range(B * nblk + 1, B * nblk + 1 + spare))

    def plan():
        return split_into_chains(meta.tree_mask, qsl, seq_lens, block_table, BLOCK, spare_ids)

    c = plan()
    key = torch.randn(B * T, KVH, D, generator=gen)
    c_sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=c.num_chains, num_heads=H, num_kv_heads=KVH, head_dim=D,
        seq_lens=c.seq_lens, dtype=torch.float32, query_start_loc=c.query_start_loc,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    c_out = torch.empty_like(query)

    def chains():  # what TreeCPUAttentionImpl._verify_chains does per layer
        for src, dst, count in c.copies:
            cache[dst: dst + count].copy_(cache[src].expand((count,) + cache.shape[1:]))
        if c.write_rows.numel():
            ops.cpu_attn_reshape_and_cache(key[c.write_rows], key[c.write_rows], key_cache,
                                           value_cache, c.write_slots, isa)
        q = query[c.order]
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=c.query_start_loc, seq_lens=c.seq_lens, scale=D ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=c.block_table,
            softcap=0.0, scheduler_metadata=c_sched, s_aux=None)
        c_out[c.order] = out
        return c_out

    return native, chains, tree, plan


def best_ms(fns, reps: int) -> list[float]:
    """Best time of each function, calls interleaved (this machine's speed drifts)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [1e3 * b for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--trees", default="4,8,16,32")
    ap.add_argument("--prefixes", default="128,1024")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print("| B | tree T | prefix P | native ms | chains ms | tree ms | plan ms (per step) "
          "| chains / native | tree / native |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B in map(int, args.batches.split(",")):
        for P in map(int, args.prefixes.split(",")):
            for T in map(int, args.trees.split(",")):
                native, chains, tree, plan = setup(B, T, P, gen)
                n, c, t, p = best_ms([native, chains, tree, plan], args.reps)
                rows.append({"B": B, "T": T, "P": P, "native_ms": n, "chains_ms": c,
                             "tree_ms": t, "plan_ms": p})
                print(f"| {B} | {T} | {P} | {n:.3f} | {c:.3f} | {t:.3f} | {p:.3f} "
                      f"| {c / n:.1f} | {t / n:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "machine": platform.processor() or
                       platform.machine(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
