"""What a sampled tree step costs, part by part: work for every node against work
for only the nodes (or tokens) the step reads.

Each part times the real functions both ways on the same inputs and checks that both
give the same result:

* ``acceptance``: at T > 0 each node's logits become the request's distribution
  (temperature, top-k, top-p: a sort of the whole vocabulary per row) before the
  lossless multi-draft walk, which reads at most depth + 1 nodes of each tree;
  ``engine.accept.node_probs`` computes those on demand. Likewise for seeded
  requests, which sample with per-position noise: every node's sample
  (``position_samples``) against the samples on the path they choose
  (``position_samples_on_path``). Same accepted tokens. The target puts ``--peak``
  extra logit on each node's first child, so walks go as deep as real ones do
  (reported).
* ``node_logits``: ``tree_sampler.sample_with_trees`` itself, with every node's row
  processed first (float32 copy, allowed-token mask, penalties: the whole table
  stands in for ``NodeLogits``, as in the unit test) against ``NodeLogits``, which
  processes only the nodes the step asks for. T 0.7, top-p 0.9, unseeded; no request
  penalised, then a third. Same tokens from the same random draws.
* ``penalties``: vLLM's ``apply_all_penalties``, which builds [rows, vocab] count and
  mask tensors for every node row it is given (outputs: the request's plus the node's
  path), against ``tree.penalties`` (here for every node:
  ``bench.tree_reference.processed_node_logits``), which gathers only the tokens of
  each penalised row's prompt and output. Prompts of 30 tokens, outputs of
  ``--output-len``; a third of the requests penalised, then all of them. The same
  logits, bit for bit.

    python -m vllm_treespec.bench.tree_step_costs [--part PART,...] [--batch 1,16,100] [--out FILE]

Trees: 13 nodes, depth 4 (3, 5, 3 and 1 nodes at depths 1 to 4, widest under the best
branch), a shape the adaptive budget drafts at batch 1. ``--batch`` and ``--repeats``
default per part (acceptance: 1,16,32 and the median of 20; node_logits: 1,16,100 and
the best of 7; penalties: 1,16,100 and the best of 5).
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
                                                position_samples_on_path,
                                                processed_node_logits)
from vllm_treespec.tree import TreeBatch, greedy_accept, stochastic_accept
from vllm_treespec.engine import accept as engine_accept
from vllm_treespec.engine.accept import TreeSampling, node_probs
from vllm_treespec.engine.step import VerifyStep, node_rows
from vllm_treespec.vllm_glue import tree_sampler

VOCAB = 49152  # SmolLM2
PARENTS = [0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 6, 9]  # node i's parent (root: itself)
DEFAULTS = {"acceptance": ("1,16,32", 20), "node_logits": ("1,16,100", 7),
            "penalties": ("1,16,100", 5)}


def tree_step(B: int, gen: torch.Generator, max_children: int, prefix_len: int):
    """B trees of shape ``PARENTS`` with random tokens, laid out as a verify step:
    (step, tokens [B, T])."""
    T = len(PARENTS)
    tokens = torch.randint(0, VOCAB, (B, T), generator=gen)
    tree = TreeBatch.from_parents(tokens.tolist(), [PARENTS] * B, tree_size=T,
                                  max_children=max_children)
    step = VerifyStep(req_index=torch.arange(B), tree=tree,
                      prefix_len=torch.full((B,), prefix_len),
                      token_start=torch.arange(B) * T, logit_start=torch.arange(B) * T,
                      num_reqs=B)
    return step, tokens


def penalised_step(B: int, penalised_every: int, output_len: int, gen: torch.Generator):
    """A verify step whose every ``penalised_every``-th request has repetition,
    frequency and presence penalties: (step, sampling metadata, logits)."""
    step, _ = tree_step(B, gen, max_children=4, prefix_len=30)
    on = torch.arange(B) % penalised_every == penalised_every - 1
    md = SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=False,
        prompt_token_ids=torch.randint(0, VOCAB, (B, 30), generator=gen),
        repetition_penalties=torch.where(on, 1.3, 1.0),
        frequency_penalties=torch.where(on, 0.5, 0.0), presence_penalties=torch.where(on, 0.4, 0.0),
        output_token_ids=[torch.randint(0, VOCAB, (output_len,), generator=gen).tolist()
                          for _ in range(B)])
    return step, md, torch.randn(B * len(PARENTS), VOCAB, generator=gen)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


# ---- acceptance ---------------------------------------------------------------------------

def acceptance(args, B: int, gen: torch.Generator) -> dict:
    step, tokens = tree_step(B, gen, max_children=3, prefix_len=100)
    T, D = step.tree.tree_size, step.tree.max_depth
    processed = torch.randn(B, T, VOCAB, generator=gen) * 2
    first_child = {}
    for node, parent in enumerate(PARENTS[1:], start=1):
        first_child.setdefault(parent, node)
    for parent, child in first_child.items():
        processed[torch.arange(B), parent, tokens[:, child]] += args.peak
    sampling = TreeSampling(all_greedy=False, temperature=torch.full((B,), args.temperature),
                            top_p=torch.full((B,), args.top_p) if args.top_p < 1 else None,
                            top_k=torch.full((B,), args.top_k) if args.top_k else None)
    probs = functools.partial(node_probs, processed, step, sampling)
    ways = {
        "whole_table": lambda u, n: stochastic_accept(
            step.tree, node_table(probs, torch.arange(B), T), u, n),
        "on_demand": lambda u, n: stochastic_accept(step.tree, probs, u, n),
        "seeded_every_node": lambda u, n: greedy_accept(step.tree, position_samples(
            node_table(probs, torch.arange(B), T), step.tree.depth, n)),
        "seeded_on_path": lambda u, n: greedy_accept(
            step.tree, position_samples_on_path(step.tree, probs, n)),
    }
    times = {name: [] for name in ways}
    accepted = []
    for _ in range(args.repeats):
        u = torch.rand(B, D, step.tree.max_children, generator=gen)
        n = torch.empty(B, VOCAB).exponential_(generator=gen)
        n_pos = torch.empty(B, D + 1, VOCAB).exponential_(generator=gen)
        results = {}
        for name, fn in ways.items():
            seconds, results[name] = timed(fn, u, n_pos if name.startswith("seeded") else n)
            times[name].append(seconds)
        assert torch.equal(results["whole_table"].tokens, results["on_demand"].tokens)
        assert torch.equal(results["seeded_every_node"].tokens, results["seeded_on_path"].tokens)
        accepted.append(float(results["on_demand"].num_accepted.float().mean()))
    row = {"batch": B, "nodes": T,
           **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
           "mean_accepted": statistics.mean(accepted)}
    row["speedup"] = row["whole_table_ms"] / row["on_demand_ms"]
    row["seeded_speedup"] = row["seeded_every_node_ms"] / row["seeded_on_path_ms"]
    print(f"B={B:3d} T={T}: whole table {row['whole_table_ms']:8.2f} ms, on demand "
          f"{row['on_demand_ms']:7.2f} ms ({row['speedup']:.1f}x), accepted "
          f"{row['mean_accepted']:.2f} drafts/tree; seeded: every node "
          f"{row['seeded_every_node_ms']:8.2f} ms, on the path "
          f"{row['seeded_on_path_ms']:7.2f} ms ({row['seeded_speedup']:.1f}x)", flush=True)
    return row


# ---- node logits --------------------------------------------------------------------------

class WholeTable:
    """Every node of every tree processed up front (the step before ``NodeLogits``)."""

    def __init__(self, logits, step, sampling, _real=engine_accept.NodeLogits):
        self.table = _real(logits, step, sampling).of_trees()

    def __getitem__(self, index):
        return self.table[index]

    def of_trees(self, trees=None):
        return self.table if trees is None else self.table[trees]


def sampled_step(logits, step, md, seed: int):
    torch.manual_seed(seed)
    out, _ = tree_sampler.sample_with_trees(None, logits, None, md, step, {})
    return out.sampled_token_ids


def node_logits(args, B: int, gen: torch.Generator) -> list[dict]:
    real, rows = engine_accept.NodeLogits, []
    for every, label in ((B + 1, "none"), (3, "a third")):
        step, md, logits = penalised_step(B, every, args.output_len, gen)
        md = SimpleNamespace(**vars(md), all_greedy=False, max_num_logprobs=None,
                             temperature=torch.full((B,), 0.7), top_k=None,
                             top_p=torch.full((B,), 0.9))
        md.no_penalties = label == "none"
        times = {"whole_table": [], "on_demand": []}
        for rep in range(args.repeats):
            try:
                engine_accept.NodeLogits = WholeTable
                t_whole, whole = timed(sampled_step, logits, step, md, rep)
            finally:
                engine_accept.NodeLogits = real
            t_lazy, lazy = timed(sampled_step, logits, step, md, rep)
            assert torch.equal(whole, lazy)
            times["whole_table"].append(t_whole)
            times["on_demand"].append(t_lazy)
        row = {"batch": B, "penalised": label,
               **{f"{k}_ms": round(1e3 * min(v), 2) for k, v in times.items()}}
        row["speedup"] = round(row["whole_table_ms"] / row["on_demand_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


# ---- penalties ----------------------------------------------------------------------------

def every_row(logits, step, md) -> torch.Tensor:
    """vLLM's op on every node row (outputs: the request's plus the node's path)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    T = step.tree.tree_size
    outputs = []
    for i, b in enumerate(step.req_index.tolist()):
        for node in range(T):
            path = step.tree.ancestors[i, node, 1: int(step.tree.depth[i, node]) + 1]
            outputs.append(md.output_token_ids[b] + step.tree.token[i, path].tolist())
    r = step.req_index.repeat_interleave(T)
    x = logits[node_rows(step).reshape(-1)].float()
    return apply_all_penalties(x, md.prompt_token_ids[r], md.presence_penalties[r],
                               md.frequency_penalties[r], md.repetition_penalties[r],
                               outputs).view(step.tree.batch_size, T, -1)


def penalties(args, B: int, gen: torch.Generator) -> list[dict]:
    def best_ms(fn) -> float:
        return round(1e3 * min(timed(fn)[0] for _ in range(args.repeats)), 1)

    rows = []
    for every, label in ((3, "a third"), (1, "all")):
        step, md, logits = penalised_step(B, every, args.output_len, gen)
        assert torch.equal(processed_node_logits(logits, step, md), every_row(logits, step, md))
        rows.append({"batch": B, "penalised": label,
                     "every_row_ms": best_ms(lambda: every_row(logits, step, md)),
                     "tree_penalties_ms": best_ms(
                         lambda: processed_node_logits(logits, step, md))})
        print(rows[-1], flush=True)
    return rows


PARTS = {"acceptance": acceptance, "node_logits": node_logits, "penalties": penalties}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default=",".join(PARTS),
                   help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--batch", default=None, help="trees per step, comma-separated")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.7, help="acceptance")
    p.add_argument("--top-p", type=float, default=0.9, help="acceptance")
    p.add_argument("--top-k", type=int, default=0, help="acceptance; 0: no top-k")
    p.add_argument("--peak", type=float, default=9.0, help="acceptance")
    p.add_argument("--output-len", type=int, default=64, help="node_logits, penalties")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = p.parse_args(argv)
    parts = args.part.split(",")
    if unknown := set(parts) - set(PARTS):
        p.error(f"--part: unknown {', '.join(sorted(unknown))} (of: {', '.join(PARTS)})")
    result = {}
    for part in parts:
        batch, repeats = DEFAULTS[part]
        part_args = argparse.Namespace(**{**vars(args), "repeats": args.repeats or repeats})
        gen = torch.Generator().manual_seed(0)
        print(f"# {part}", flush=True)
        rows = []
        for B in map(int, (args.batch or batch).split(",")):
            got = PARTS[part](part_args, B, gen)
            rows += got if isinstance(got, list) else [got]
        result[part] = {"repeats": part_args.repeats, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args),
                       "parts": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
