"""The adaptive budget's predictions against the steps they bought (in process).

One ``eagle3_tree`` engine (defaults) decodes a few chat prompts one at a time.
Every ``plan_depth`` decision is recorded with the predicted throughput ratio
of each depth as a tree and as a chain, and every step time the runner feeds
the budget (``observe_step``). The report groups the plan-to-plan cycle (the
whole step, drafting included) by decision, next to the step time the cost
model saw, and prints the prediction of one mid-run plan: a decision that
runs longer than its prediction carries cost the model does not see. It also
records what each plan's drafts then accepted (``observe_acceptance``) next to
the gain the plan was bought for: an estimate biased upward picks trees where
the chain wins.

    python benchmarks/budget_trace.py --prompts 3 --max-tokens 256 --out trace.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

PROMPTS = ["Write a Python function that merges two sorted lists and explain it.",
           "Explain how a hash map works, with an example in Python.",
           "Tell a short story about a lighthouse keeper.",
           "List the steps to bake bread at home."]


def install(log: list):
    """An in-process worker hook (the engine runs in this process) wrapping the budget."""
    def hook(worker) -> bool:
        from vllm_treespec.tree.accept import Outcome

        runner = worker.model_runner
        policy = runner.tree_policy
        plan_depth, observe_step = policy.plan_depth, policy.observe_step
        select, observe_acceptance = policy.select, policy.observe_acceptance

        def plan(batch):
            # One pass over every depth (as plan_depth prices them): the hook's own
            # time falls inside the plan-to-plan cycle it measures.
            ratios = policy._ratios(batch)
            preds = None if ratios is None else {
                f"{d}{'c' if c else 't'}": float(ratios[d - 1, int(c)])
                for d in range(1, policy.D + 1) for c in (False, True)}
            depth = plan_depth(batch)
            log.append({"t": time.perf_counter(), "kind": "plan", "d": depth,
                        "chain": policy.chain_mode, "probe": policy.probing, "preds": preds,
                        "plain_s": policy.step_cost(batch), "acc": policy.accepted_at,
                        "chain_acc": policy.chain_accepted_at,
                        "branch_cost": policy.branch_cost, "nodes_at": policy.nodes_at})
            return depth

        def observe(num_tokens, seconds, branching=False):
            log.append({"t": time.perf_counter(), "kind": "step", "n": num_tokens,
                        "s": seconds, "branching": branching})
            return observe_step(num_tokens, seconds, branching)

        def pick(scores, max_nodes, chain=None):
            budget, chain_only = select(scores, max_nodes, chain)
            log.append({"t": time.perf_counter(), "kind": "select",
                        "nodes": budget.tolist(), "chain_only": chain_only})
            return budget, chain_only

        def accepted(outcome, depth_used, predicted):
            if not isinstance(outcome, Outcome):  # a bare list, as observe_acceptance takes
                outcome = Outcome.of_chains(outcome)
            log.append({"t": time.perf_counter(), "kind": "accept",
                        "accepted": list(outcome.accepted),
                        "chain_accepted": list(outcome.chain_accepted),
                        "chain_censored": list(outcome.chain_censored),
                        "predicted": predicted, "kappa": policy.kappa})
            return observe_acceptance(outcome, depth_used, predicted)

        policy.plan_depth, policy.observe_step = plan, observe
        policy.select, policy.observe_acceptance = pick, accepted
        return True
    return hook


def report(log: list) -> dict:
    plans = [e for e in log if e["kind"] == "plan"]
    steps = [e for e in log if e["kind"] == "step"]
    cycle, seen = collections.defaultdict(list), collections.defaultdict(list)
    for prev, cur in zip(plans, plans[1:]):
        key = f"depth {prev['d']} {'chain' if prev['chain'] else 'tree'}"
        cycle[key].append(1e3 * (cur["t"] - prev["t"]))
        seen[key].append(1e3 * sum(s["s"] for s in steps if prev["t"] < s["t"] < cur["t"]))
    mid = plans[len(plans) // 2] if plans else None
    return {"plans": len(plans),
            "by_decision": {k: {"plans": len(v), "cycle_ms_median": statistics.median(v),
                                "observed_step_ms_median": statistics.median(seen[k])}
                            for k, v in sorted(cycle.items())},
            "acceptance_by_decision": realised(log),
            "mid_run_plan": mid}


def realised(log: list) -> dict:
    """Per decision (depth, tree or chain, and whether the selection kept a
    chain), the gain the plan predicted (1 + its estimates summed to its depth)
    against what its drafts accepted (1 + accepted), and the leading chain's part
    of it: in tree mode, what the chain alone would have collected at most."""
    groups: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    plan = chosen = None
    for e in log:
        if e["kind"] == "plan":
            plan, chosen = e, None
        elif e["kind"] == "select":
            chosen = e
        elif e["kind"] == "accept" and plan is not None and plan["d"] > 0:
            d, est = plan["d"], plan["chain_acc"] if plan["chain"] else plan["acc"]
            mode = "chain" if plan["chain"] else (
                "tree, kept chains" if chosen and chosen["chain_only"] else "tree, branching")
            g = groups[f"depth {d} {mode}{' (probe)' if plan['probe'] else ''}"]
            g["predicted"].append(1.0 + sum(est[:d]))
            g["realised"].append(1.0 + statistics.mean(e["accepted"]))
            g["chain_part"].append(1.0 + statistics.mean(e["chain_accepted"]))
            if chosen:
                g["nodes"].append(statistics.mean(chosen["nodes"]))
            plan = None  # one outcome per plan
    return {k: {"steps": len(g["realised"]), **{f"{n}_mean": round(statistics.mean(v), 3)
                                                for n, v in g.items() if v}}
            for k, g in sorted(groups.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", help="write the raw log and the report here (JSON)")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hook needs the worker here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_treespec.commands.cpu_openmp import libiomp5

    if "libiomp5" not in os.environ.get("LD_PRELOAD", "") and libiomp5() is not None:
        print(f"[budget_trace] note: start with LD_PRELOAD={libiomp5()} to time what "
              f"`vllm-treespec serve` runs (the loader reads it at process start)")
    from vllm import LLM, SamplingParams

    from vllm_treespec.assets import ensure_assets

    assets = ensure_assets()
    llm = LLM(model=str(assets.target), dtype="float32", max_model_len=4096, max_num_seqs=1,
              enable_prefix_caching=False,
              speculative_config={"method": "eagle3_tree", "model": str(assets.drafter)})
    log: list = []
    llm.collective_rpc(install(log))
    tok = llm.get_tokenizer()
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for text in PROMPTS[:args.prompts]:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
        llm.generate([prompt], sampling, use_tqdm=False)
    result = report(log)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"report": result, "log": log}, f)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
