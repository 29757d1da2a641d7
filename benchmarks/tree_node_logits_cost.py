"""Cost of a sampled tree step's acceptance: every node's logits processed first
against only the nodes the step reads (``tree_sampler.NodeLogits``).

At T > 0 the lossless walk reads at most depth + 1 nodes of each sampled tree,
yet the step used to copy every node's row of logits to float32, apply the
allowed-token mask and penalties to all of them, and take their argmax. This
times ``tree_sampler.sample_with_trees`` itself both ways on the same inputs
(the whole table stands in for ``NodeLogits``, as in the unit test) and checks
that they emit the same tokens from the same random draws.

    python benchmarks/tree_node_logits_cost.py [--batch 1,16,100] [--out FILE]

Trees: 13 nodes, depth 4 (as ``tree_penalties_cost.py``, whose inputs it reuses);
temperature 0.7, top-p 0.9, unseeded; no request penalised, then a third.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm_treespec.vllm_glue import tree_sampler


class WholeTable:
    """Every node of every tree processed up front (the step before ``NodeLogits``)."""

    def __init__(self, logits, step, md, _real=tree_sampler.NodeLogits):
        self.table = _real(logits, step, md).of_trees()

    def __getitem__(self, index):
        return self.table[index]

    def of_trees(self, trees=None):
        return self.table if trees is None else self.table[trees]


def timed_step(logits, step, md, seed: int):
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out, _ = tree_sampler.sample_with_trees(None, logits, None, md, step, {})
    return time.perf_counter() - t0, out.sampled_token_ids


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from tree_penalties_cost import make

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,16,100")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    real = tree_sampler.NodeLogits
    rows = []
    for B in map(int, args.batch.split(",")):
        for every, label in ((B + 1, "none"), (3, "a third")):
            step, md, logits = make(B, every, args.output_len, gen)
            md = SimpleNamespace(**vars(md), all_greedy=False, max_num_logprobs=None,
                                 temperature=torch.full((B,), 0.7), top_k=None,
                                 top_p=torch.full((B,), 0.9))
            md.no_penalties = label == "none"
            times = {"whole_table": [], "on_demand": []}
            for rep in range(args.repeats):
                tree_sampler.NodeLogits = WholeTable
                t_whole, whole = timed_step(logits, step, md, rep)
                tree_sampler.NodeLogits = real
                t_lazy, lazy = timed_step(logits, step, md, rep)
                assert torch.equal(whole, lazy)
                times["whole_table"].append(t_whole)
                times["on_demand"].append(t_lazy)
            row = {"batch": B, "penalised": label,
                   **{f"{k}_ms": round(1e3 * min(v), 2) for k, v in times.items()}}
            row["speedup"] = round(row["whole_table_ms"] / row["on_demand_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
