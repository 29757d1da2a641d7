"""The adaptive budget's predictions against the steps they bought (in process).

One batch-1 ``--method`` engine (``eagle3_tree`` with its defaults unless told)
decodes a few chat prompts one at a time (four short ones, or with ``--pangu240``
the first pangu240 first turns).
Every ``plan_depth`` decision is recorded with the predicted throughput ratio
of each depth as a tree and as a chain, and every step time the runner feeds
the budget (``observe_step``). The report groups the plan-to-plan cycle (the
whole step, drafting included) by decision, next to the step time the cost
model saw, and prints the prediction of one mid-run plan: a decision that
runs longer than its prediction carries cost the model does not see. It also
records what each plan's drafts then accepted (``observe_acceptance``) next to
the gain the plan was bought for: an estimate biased upward picks trees where
the chain wins.

And the step-cost table against live steps (``step_costs``): per verified-token
count N (and whether the step's trees branched), the median live step time next
to the startup sweep's value at N (``vllm_glue/calibration.py``), with their
difference and ratio: whether a live step is the sweep plus a fixed amount or the
sweep times a factor decides how the table (``policy.StepCostTable``) follows live
steps. Also the table after the run, the learned branching extra and the
process's page faults and context switches per step.

    python -m vllm_treespec.bench.budget_trace --prompts 3 --max-tokens 256 --out trace.json
    python -m vllm_treespec.bench.budget_trace --pangu240 --prompts 8 --out trace.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import time

PROMPTS = ["Write a Python function that merges two sorted lists and explain it.",
           "Explain how a hash map works, with an example in Python.",
           "Tell a short story about a lighthouse keeper.",
           "List the steps to bake bread at home."]


def _table(policy) -> list[list[float]]:
    return [list(policy.step_cost.n), list(policy.step_cost.t)]


def _usage() -> list[int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return [usage.ru_minflt, usage.ru_nivcsw]


def install(log: list, state: dict):
    """An in-process worker hook (the engine runs in this process) wrapping the
    budget; ``state`` gets the startup sweep, and ``collect(state)`` the rest."""
    def hook(worker) -> bool:
        from vllm_treespec.tree.accept import Outcome

        runner = worker.model_runner
        policy = runner.adaptive_budget
        state.update(sweep=_table(policy), usage0=_usage())
        plan_depth, observe_step = policy.plan_depth, policy.observe_step
        select, observe_acceptance = policy.select, policy.observe_acceptance

        def plan(batch):
            # One pass over every depth (as plan_depth prices them): the hook's own
            # time falls inside the plan-to-plan cycle it measures.
            ratios = policy.predicted_ratios(batch)
            preds = None if ratios is None else {
                f"{d}{'c' if c else 't'}": float(ratios[d - 1, int(c)])
                for d in range(1, policy.max_depth + 1) for c in (False, True)}
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


def collect(state: dict):
    """A worker hook: the step-cost table and what it learned, after the run."""
    def hook(worker) -> bool:
        policy = worker.model_runner.adaptive_budget
        state.update(table=_table(policy), branch_cost_s=policy.branch_cost,
                     nodes_at=list(policy.nodes_at), usage1=_usage())
        return True
    return hook


def report(log: list, state: dict | None = None) -> dict:
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
            "step_costs": step_costs(log, state) if state else None,
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


def step_costs(log: list, state: dict) -> dict:
    """Live steps by verified tokens (chains and branching trees apart) against the
    startup sweep at the same N; the table after the run."""
    import numpy as np

    sweep_n, sweep_t = state["sweep"]
    groups: dict[tuple[int, bool], list[float]] = collections.defaultdict(list)
    steps = [e for e in log if e["kind"] == "step"]
    for e in steps:
        groups[int(e["n"]), bool(e["branching"])].append(e["s"])
    rows = []
    for (n, branching), times in sorted(groups.items()):
        live, swept = statistics.median(times), float(np.interp(n, sweep_n, sweep_t))
        rows.append({"tokens": n, "branching": branching, "steps": len(times),
                     "live_ms": round(1e3 * live, 2), "sweep_ms": round(1e3 * swept, 2),
                     "difference_ms": round(1e3 * (live - swept), 2),
                     "ratio": round(live / swept, 3)})
    per_step = max(1, len(steps))
    faults, switches = (b - a for a, b in zip(state["usage0"], state["usage1"]))
    return {"rows": rows,
            "sweep_ms": {int(n): round(1e3 * t, 2) for n, t in zip(sweep_n, sweep_t) if n <= 64},
            "table_after_ms": {int(n): round(1e3 * t, 2)
                               for n, t in zip(*state["table"]) if n <= 64},
            "branch_cost_ms": round(1e3 * state["branch_cost_s"], 2),
            "nodes_at": [round(x, 2) for x in state["nodes_at"]],
            "minor_faults_per_step": round(faults / per_step, 1),
            "involuntary_switches_per_step": round(switches / per_step, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="eagle3_tree", help="an eagle3_tree method, as in bench")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--pangu240", action="store_true",
                    help="the first N pangu240 first turns instead of the short prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", help="write the raw log and the report here (JSON)")
    args = ap.parse_args(argv)
    if not args.pangu240 and args.prompts > len(PROMPTS):
        ap.error(f"--prompts: {len(PROMPTS)} short prompts (or --pangu240)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hook needs the worker here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_treespec.cpu_openmp import libiomp5

    if "libiomp5" not in os.environ.get("LD_PRELOAD", "") and libiomp5() is not None:
        print(f"[budget_trace] note: start with LD_PRELOAD={libiomp5()} to time what "
              f"`vllm-treespec serve` runs (the loader reads it at process start)")
    from vllm import SamplingParams

    from vllm_treespec.bench import pangu240
    from vllm_treespec.bench.interleaved_ab import batch1_engine, chat_prompts  # as the A/B

    llm = batch1_engine(args.method)
    log: list = []
    state: dict = {}
    llm.collective_rpc(install(log, state))
    tok = llm.get_tokenizer()
    if args.pangu240:
        texts = chat_prompts(tok, pangu240.first_turns(args.prompts))
    else:
        texts = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
                 for text in PROMPTS[:args.prompts]]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokens, t0 = 0, time.perf_counter()
    for text in texts:
        tokens += len(llm.generate([text], sampling, use_tqdm=False)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    llm.collective_rpc(collect(state))
    result = {"method": args.method, "tok_s": round(tokens / seconds, 2), **report(log, state)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"report": result, "log": log}, f)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
