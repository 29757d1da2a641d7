"""Cost of accepting trees at temperature > 0: target distributions of every node
against only the nodes the acceptance walk reads.

A tree step at T > 0 turns each node's logits into the request's distribution
(temperature, top-k, top-p: a sort of the whole vocabulary per row) before the
lossless multi-draft walk. The walk reads at most depth + 1 nodes of each tree,
so ``tree_sampler.node_probs`` computes those on demand. This times both ways on
the same inputs with the real functions and checks they accept the same tokens;
likewise for seeded requests, which sample with per-position noise: every node's
sample (``position_samples``) against the samples on the path they choose
(``position_samples_on_path``).

    python benchmarks/tree_sampling_cost.py [--batch 1,16,32] [--top-p 0.9] [--out FILE]

Trees: 13 nodes, depth 4 (3, 5, 3 and 1 nodes at depths 1 to 4, widest under the best
branch), a shape the adaptive budget drafts at batch 1. The target puts ``--peak`` extra
logit on each node's first child, so walks go as deep as real ones do (reported).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from types import SimpleNamespace

import torch

from vllm_treespec.bench.tree_reference import (node_table, position_samples,
                                                position_samples_on_path)
from vllm_treespec.tree import TreeBatch, greedy_accept, stochastic_accept
from vllm_treespec.vllm_glue.tree_sampler import VerifyStep, node_probs

VOCAB = 49152  # SmolLM2
PARENTS = [0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 6, 9]  # node i's parent (root: itself)


def make_step(B: int, peak: float, gen: torch.Generator):
    tokens = torch.randint(0, VOCAB, (B, len(PARENTS)), generator=gen)
    tree = TreeBatch.from_parents(tokens.tolist(), [PARENTS] * B, tree_size=len(PARENTS),
                                  max_children=3)
    T = tree.tree_size
    step = VerifyStep(req_index=torch.arange(B), tree=tree, prefix_len=torch.full((B,), 100),
                      token_start=torch.arange(B) * T, logit_start=torch.arange(B) * T,
                      num_reqs=B)
    processed = torch.randn(B, T, VOCAB, generator=gen) * 2
    first_child = {}
    for node, parent in enumerate(PARENTS[1:], start=1):
        first_child.setdefault(parent, node)
    for parent, child in first_child.items():
        processed[torch.arange(B), parent, tokens[:, child]] += peak
    return step, processed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,32")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    ap.add_argument("--peak", type=float, default=9.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in map(int, args.batch.split(",")):
        step, processed = make_step(B, args.peak, gen)
        T = step.tree.tree_size
        md = SimpleNamespace(temperature=torch.full((B,), args.temperature),
                             top_p=torch.full((B,), args.top_p) if args.top_p < 1 else None,
                             top_k=torch.full((B,), args.top_k) if args.top_k else None)
        probs = functools.partial(node_probs, processed, step, md)

        def whole_table(u, n):
            return stochastic_accept(step.tree, node_table(probs, torch.arange(B), T), u, n)

        def on_demand(u, n):
            return stochastic_accept(step.tree, probs, u, n)

        def seeded_every_node(u, n):
            return greedy_accept(step.tree, position_samples(
                node_table(probs, torch.arange(B), T), step.tree.depth, n))

        def seeded_on_path(u, n):
            return greedy_accept(step.tree, position_samples_on_path(step.tree, probs, n))

        ways = {"whole_table": whole_table, "on_demand": on_demand,
                "seeded_every_node": seeded_every_node, "seeded_on_path": seeded_on_path}
        times = {name: [] for name in ways}
        accepted = []
        D = step.tree.max_depth
        for _ in range(args.reps):
            u = torch.rand(B, D, step.tree.max_children, generator=gen)
            n = torch.empty(B, VOCAB).exponential_(generator=gen)
            n_pos = torch.empty(B, D + 1, VOCAB).exponential_(generator=gen)
            results = {}
            for name, fn in ways.items():
                t0 = time.perf_counter()
                results[name] = fn(u, n_pos if name.startswith("seeded") else n)
                times[name].append(time.perf_counter() - t0)
            assert torch.equal(results["whole_table"].tokens, results["on_demand"].tokens)
            assert torch.equal(results["seeded_every_node"].tokens,
                               results["seeded_on_path"].tokens)
            accepted.append(float(results["on_demand"].num_accepted.float().mean()))
        row = {"batch": B, "nodes": T,
               **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
               "mean_accepted": statistics.mean(accepted)}
        row["speedup"] = row["whole_table_ms"] / row["on_demand_ms"]
        row["seeded_speedup"] = row["seeded_every_node_ms"] / row["seeded_on_path_ms"]
        rows.append(row)
        print(f"B={B:3d} T={T}: whole table {row['whole_table_ms']:8.2f} ms, on demand "
              f"{row['on_demand_ms']:7.2f} ms ({row['speedup']:.1f}x), accepted "
              f"{row['mean_accepted']:.2f} drafts/tree; seeded: every node "
              f"{row['seeded_every_node_ms']:8.2f} ms, on the path "
              f"{row['seeded_on_path_ms']:7.2f} ms ({row['seeded_speedup']:.1f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(),
                       "cpu": platform.processor() or platform.machine(), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
