"""Per-step overhead of the tree core (everything but the model forwards).

Times, per speculative step on the CPU: dynamic tree build (top-k expansion over
the draft vocabulary at every depth + rerank) and tensorization, the tree mask and
positions, acceptance (greedy and stochastic), and the KV compaction plan. Drafter
and target outputs are generated up front: they are model costs, not ours. Then
the copy-branch search (``CopySource.find``), which runs on the host for every
request every step, drafting or not: B requests with histories of each
``--copy-history`` length, of random tokens (nothing to copy: the cost of finding
nothing) and of a repeating text (every step finds its branches), searched in
the last ``HISTORY_WINDOW`` tokens and, for comparison, in the last 4096.

    python -m vllm_treespec.bench.tree_overhead [--out benchmarks/out/tree_overhead.json]

Target (not a test): <= 2 ms per step at B=1, M=32, growing sub-linearly in B.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from vllm_treespec.tree import (
    DynamicTreeBuilder,
    compaction_plan,
    greedy_accept,
    stochastic_accept,
    tree_mask,
)

OLD_WINDOW = 4096  # the copy search's window before HISTORY_WINDOW, for comparison
DRAFT_VOCAB = 8192   # typical EAGLE-3 draft vocabulary
TARGET_VOCAB = 49152  # SmolLM2
BLOCK_SIZE = 16


def make_inputs(B: int, M: int, top_k: int, depth: int, gen: torch.Generator):
    root = torch.randn(B, DRAFT_VOCAB, generator=gen).log_softmax(-1)
    levels = [torch.randn(B, top_k, DRAFT_VOCAB, generator=gen).log_softmax(-1)
              for _ in range(depth - 1)]
    T = 1 + M
    target_argmax = torch.randint(0, DRAFT_VOCAB, (B, T), generator=gen)
    target_probs = torch.randn(B, T, TARGET_VOCAB, generator=gen).softmax(-1)
    prefix = torch.randint(100, 1000, (B,), generator=gen)
    block_table = torch.arange(B * 128, dtype=torch.int32).view(B, 128)
    return root, levels, target_argmax, target_probs, prefix, block_table


def one_step(B, M, top_k, depth, inputs, stochastic: bool):
    root, levels, target_argmax, target_probs, prefix, block_table = inputs
    builder = DynamicTreeBuilder(B, top_k, depth, M)
    builder.first_level(root)
    for lp in levels:
        builder.next_level(lp)
    tree = builder.finish(target_argmax[:, 0])
    tree_mask(tree)
    prefix.unsqueeze(1) + tree.depth  # rotary positions: prefix + depth
    if stochastic:
        acc = stochastic_accept(tree, target_probs)
    else:
        acc = greedy_accept(tree, target_argmax)
    plan = compaction_plan(acc)
    plan.slots(prefix, block_table, BLOCK_SIZE)


def bench(B, M, top_k, depth, stochastic, reps, gen):
    inputs = make_inputs(B, M, top_k, depth, gen)
    for _ in range(3):
        one_step(B, M, top_k, depth, inputs, stochastic)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        one_step(B, M, top_k, depth, inputs, stochastic)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def copy_search_ms(B: int, length: int, repeating: bool, reps: int, gen,
                   window: int) -> float:
    import numpy as np

    from vllm_treespec.vllm_glue.copy_source import CopySource

    if repeating:  # a 50-token text over and over: matches everywhere
        unit = torch.randint(0, TARGET_VOCAB, (50,), generator=gen)
        ids = unit.repeat(B, length // 50 + 1)[:, :length]
    else:
        ids = torch.randint(0, TARGET_VOCAB, (B, length), generator=gen)
    ids = ids.numpy().astype(np.int64)
    num, roots = np.full(B, length), ids[:, -1].tolist()
    source = CopySource(2, 8, window=window)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        source.find(ids, num, roots)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--nodes", default="8,16,32,64")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--copy-history", default="400,4096,32768,131072",
                    help="history lengths (tokens) for the copy-branch search")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out", "tree_overhead.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'B':>4} {'M':>4} {'greedy ms':>10} {'stoch ms':>10} {'greedy/B ms':>12}")
    for B in [int(x) for x in args.batch.split(",")]:
        for M in [int(x) for x in args.nodes.split(",")]:
            k = min(args.top_k, M)
            g_med, g_min = bench(B, M, k, args.depth, False, args.reps, gen)
            s_med, s_min = bench(B, M, k, args.depth, True, max(5, args.reps // 3), gen)
            rows.append({"batch": B, "num_nodes": M, "top_k": k, "depth": args.depth,
                         "greedy_ms_median": round(g_med, 3), "greedy_ms_min": round(g_min, 3),
                         "stochastic_ms_median": round(s_med, 3),
                         "stochastic_ms_min": round(s_min, 3)})
            print(f"{B:>4} {M:>4} {g_med:>10.3f} {s_med:>10.3f} {g_med / B:>12.3f}")
    from vllm_treespec.vllm_glue.copy_source import HISTORY_WINDOW

    copy_rows = []
    print(f"{'B':>4} {'history':>8} {'window':>8} {'copy search ms (nothing / repeating)':>38}")
    for B in [int(x) for x in args.batch.split(",")]:
        for n in [int(x) for x in args.copy_history.split(",")]:
            for window in sorted({OLD_WINDOW, HISTORY_WINDOW}):
                none, found = (copy_search_ms(B, n, rep, args.reps, gen, window)
                               for rep in (False, True))
                copy_rows.append({"batch": B, "history": n, "window": window,
                                  "nothing_ms_median": round(none, 3),
                                  "repeating_ms_median": round(found, 3)})
                print(f"{B:>4} {n:>8} {window:>8} {none:>18.3f} / {found:.3f}")
    out = {"benchmark": "tree_overhead", "draft_vocab": DRAFT_VOCAB,
           "target_vocab": TARGET_VOCAB, "torch": torch.__version__, "copy_search": copy_rows,
           "threads": torch.get_num_threads(), "machine": platform.machine(),
           "processor": platform.processor(), "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
