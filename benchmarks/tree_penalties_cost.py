"""Cost of penalties on tree nodes: vLLM's op over every node row against
``tree.penalties`` (the trees of penalised requests, at the tokens they change).

A tree step gives each node its own row of logits, and repetition / frequency /
presence penalties see the request's output plus the node's path. vLLM's
``apply_all_penalties`` builds [rows, vocab] count and mask tensors for every row
it is given; ``tree_sampler.NodeLogits`` (here for every node:
``bench.tree_reference.processed_node_logits``) gathers only the tokens of
each penalised row's prompt and output. This times both on the same inputs with
the real functions and checks that they give the same logits, bit for bit.

    python benchmarks/tree_penalties_cost.py [--batch 1,16,100] [--out FILE]

Trees: 13 nodes, depth 4 (as ``tree_sampling_cost.py``); prompts of 30 tokens, outputs
of ``--output-len`` tokens; a third of the requests penalised, then all of them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from types import SimpleNamespace

import torch
from vllm.v1.sample.ops.penalties import apply_all_penalties

from vllm_treespec.bench.tree_reference import processed_node_logits
from vllm_treespec.vllm_glue.tree_sampler import VerifyStep, _node_rows

VOCAB = 49152  # SmolLM2
PARENTS = [0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 6, 9]


def make(B: int, penalised_every: int, output_len: int, gen: torch.Generator):
    from vllm_treespec.tree import TreeBatch

    T = len(PARENTS)
    tokens = [torch.randint(0, VOCAB, (T,), generator=gen).tolist() for _ in range(B)]
    tree = TreeBatch.from_parents(tokens, [PARENTS] * B, tree_size=T, max_children=4)
    step = VerifyStep(req_index=torch.arange(B), tree=tree, prefix_len=torch.full((B,), 30),
                      token_start=torch.arange(B) * T, logit_start=torch.arange(B) * T,
                      num_reqs=B)
    on = torch.arange(B) % penalised_every == penalised_every - 1
    md = SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=False,
        prompt_token_ids=torch.randint(0, VOCAB, (B, 30), generator=gen),
        repetition_penalties=torch.where(on, 1.3, 1.0),
        frequency_penalties=torch.where(on, 0.5, 0.0), presence_penalties=torch.where(on, 0.4, 0.0),
        output_token_ids=[torch.randint(0, VOCAB, (output_len,), generator=gen).tolist()
                          for _ in range(B)])
    return step, md, torch.randn(B * T, VOCAB, generator=gen)


def every_row(logits, step, md) -> torch.Tensor:
    """vLLM's op on every node row (outputs: the request's plus the node's path)."""
    T = step.tree.tree_size
    outputs = []
    for i, b in enumerate(step.req_index.tolist()):
        for node in range(T):
            path = step.tree.ancestors[i, node, 1: int(step.tree.depth[i, node]) + 1]
            outputs.append(md.output_token_ids[b] + step.tree.token[i, path].tolist())
    r = step.req_index.repeat_interleave(T)
    x = logits[_node_rows(step).reshape(-1)].float()
    return apply_all_penalties(x, md.prompt_token_ids[r], md.presence_penalties[r],
                               md.frequency_penalties[r], md.repetition_penalties[r],
                               outputs).view(step.tree.batch_size, T, -1)


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * min(times), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,16,100")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in map(int, args.batch.split(",")):
        for every, label in ((3, "a third"), (1, "all")):
            step, md, logits = make(B, every, args.output_len, gen)
            assert torch.equal(processed_node_logits(logits, step, md),
                               every_row(logits, step, md))
            rows.append({"batch": B, "penalised": label,
                         "every_row_ms": best_ms(lambda: every_row(logits, step, md),
                                                 args.repeats),
                         "tree_penalties_ms": best_ms(
                             lambda: processed_node_logits(logits, step, md), args.repeats)})
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
