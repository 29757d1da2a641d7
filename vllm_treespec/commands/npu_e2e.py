"""`vllm-treespec npu-check --e2e-model M --e2e-drafter D`: proof that trees ran.

Serves the target twice through vLLM's offline engine, plain decoding and
``eagle3_tree``, greedy, in one dtype (float32 by default: the dtype the greedy
identity is claimed for), with a fixed tree (``"adaptive": false``, so the run
cannot fall back to chains or to no speculation and still pass). It then reads
the tree worker's own counters and requires:

* trees were verified (``trees`` > 0), some of them branching (verify steps that
  were not all chains), with a mean tree size above one node;
* the greedy token ids of every prompt equal plain decoding's.

Each requirement is one row of the report (``npu_check.Report``). Imports vLLM
lazily (inside :func:`check_e2e`); nothing from torch_npu itself.
"""

from __future__ import annotations

import time
from typing import Any


def tree_summary(worker) -> dict:
    """collective_rpc target: the worker's cumulative tree counters."""
    return worker.model_runner.tree_metrics.total.summary()


def tree_spec(args) -> dict[str, Any]:
    return {"method": "eagle3_tree", "model": args.e2e_drafter,
            "num_nodes": args.e2e_num_nodes, "depth": args.e2e_depth,
            "top_k": args.e2e_top_k, "adaptive": False}


def judge(report, plain: list, tree: list, summary: dict | None, rates: dict) -> None:
    """The verdict rows from the two runs' outputs and the tree worker's counters."""
    s = summary or {}
    trees, steps, chains = s.get("trees", 0), s.get("steps", 0), s.get("chain_steps", 0)
    report.add("e2e/trees_verified", trees > 0 and steps - chains > 0
               and s.get("mean_tree_size", 0) > 1,
               f"{trees} trees in {steps} verify steps, {steps - chains} with a branching "
               f"tree, mean tree size {s.get('mean_tree_size', 0):.2f}, mean acceptance "
               f"length {s.get('mean_accept_len', 0):.2f}")
    same = sum(a == b for a, b in zip(plain, tree))
    first = next((i for i, (a, b) in enumerate(zip(plain, tree)) if a != b), None)
    report.add("e2e/greedy_identity", same == len(plain) and len(plain) == len(tree),
               f"{same}/{len(plain)} prompts give plain decoding's tokens"
               + ("" if first is None else f" (first difference: prompt {first})"))
    report.add("e2e/speed", None if not rates else True,
               ", ".join(f"{k} {v:.1f} tok/s" for k, v in rates.items()), required=False)


def check_e2e(report, args) -> None:
    from vllm import LLM, SamplingParams

    prompts = [f"Write a short paragraph about topic number {i}." for i in range(args.e2e_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.e2e_max_tokens)
    outputs, rates, summary = {}, {}, None
    for name, spec in (("plain", None), ("eagle3_tree", tree_spec(args))):
        llm = LLM(model=args.e2e_model, speculative_config=spec, dtype=args.e2e_dtype,
                  max_model_len=args.e2e_max_model_len, seed=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
        rates[name] = sum(map(len, outputs[name])) / seconds
        if spec is not None:
            summary = llm.collective_rpc(tree_summary)[0]
        del llm
    judge(report, outputs["plain"], outputs["eagle3_tree"], summary, rates)


def add_arguments(p) -> None:
    p.add_argument("--e2e-model", help="target model for the end-to-end check")
    p.add_argument("--e2e-drafter", help="EAGLE-3 drafter for the end-to-end check")
    p.add_argument("--e2e-dtype", default="float32",
                   help="model dtype of both runs (default float32, the dtype greedy "
                        "identity is claimed for)")
    p.add_argument("--e2e-prompts", type=int, default=8)
    p.add_argument("--e2e-max-tokens", type=int, default=128)
    p.add_argument("--e2e-max-model-len", type=int, default=4096)
    p.add_argument("--e2e-num-nodes", type=int, default=32)
    p.add_argument("--e2e-depth", type=int, default=6)
    p.add_argument("--e2e-top-k", type=int, default=8)
