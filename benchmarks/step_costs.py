"""Live verify steps against the adaptive budget's startup sweep, in one engine.

The budget's step-cost table starts from dummy forwards timed at startup
(``vllm_glue/calibration.py``) and is refined by live steps
(``policy.StepCostTable``). This runs one batch-1 engine over chat prompts and
prints, per verified-token count N (and whether the step's trees branched), the
median live step time next to the sweep's value at N, with their difference and
ratio: whether a live step is the sweep plus a fixed amount or the sweep times a
factor decides how the table should follow live steps. Also the table after the
run, the learned branching extra and the worker's faults and context switches.

    python benchmarks/step_costs.py --method eagle3_tree --prompts 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def _install(worker) -> bool:
    """collective_rpc target: record every ``observe_step`` of the budget."""
    import resource

    runner = worker.model_runner
    policy = runner.tree_policy
    usage = resource.getrusage(resource.RUSAGE_SELF)
    runner._step_costs = {"sweep": [list(policy.step_cost.n), list(policy.step_cost.t)],
                          "steps": [], "usage0": [usage.ru_minflt, usage.ru_nivcsw]}
    observe = policy.observe_step

    def observe_step(num_tokens, seconds, branching=False):
        runner._step_costs["steps"].append((num_tokens, seconds, branching))
        return observe(num_tokens, seconds, branching)

    policy.observe_step = observe_step
    return True


def _collect(worker) -> dict:
    import resource

    runner = worker.model_runner
    policy, record = runner.tree_policy, runner._step_costs
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record.update(table=[list(policy.step_cost.n), list(policy.step_cost.t)],
                  branch_cost_s=policy.branch_cost, nodes_at=list(policy.nodes_at),
                  usage1=[usage.ru_minflt, usage.ru_nivcsw])
    return record


def summarize(record: dict) -> dict:
    import numpy as np

    sweep_n, sweep_t = record["sweep"]
    groups: dict[tuple[int, bool], list[float]] = {}
    for n, seconds, branching in record["steps"]:
        groups.setdefault((int(n), bool(branching)), []).append(seconds)
    rows = []
    for (n, branching), times in sorted(groups.items()):
        live, swept = statistics.median(times), float(np.interp(n, sweep_n, sweep_t))
        rows.append({"tokens": n, "branching": branching, "steps": len(times),
                     "live_ms": round(1e3 * live, 2), "sweep_ms": round(1e3 * swept, 2),
                     "difference_ms": round(1e3 * (live - swept), 2),
                     "ratio": round(live / swept, 3)})
    steps = max(1, len(record["steps"]))
    return {"rows": rows,
            "sweep_ms": {int(n): round(1e3 * t, 2) for n, t in zip(sweep_n, sweep_t) if n <= 64},
            "table_after_ms": {int(n): round(1e3 * t, 2)
                               for n, t in zip(*record["table"]) if n <= 64},
            "branch_cost_ms": round(1e3 * record["branch_cost_s"], 2),
            "nodes_at": [round(x, 2) for x in record["nodes_at"]],
            "minor_faults_per_step": round((record["usage1"][0] - record["usage0"][0]) / steps, 1),
            "involuntary_switches_per_step":
                round((record["usage1"][1] - record["usage0"][1]) / steps, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="eagle3_tree", help="an eagle3_tree method, as in bench")
    p.add_argument("--prompts", type=int, default=8, help="first N pangu240 first turns")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of local functions
    sys.path.insert(0, str(Path(__file__).parent))
    from interleaved_ab import batch1_engine, greedy_first_turns_tok_s

    llm = batch1_engine(args.method)
    llm.collective_rpc(_install)
    tok_s = greedy_first_turns_tok_s(llm, args.prompts, args.max_tokens)
    result = {"command": "python benchmarks/step_costs.py " + " ".join(argv or sys.argv[1:]),
              "method": args.method, "tok_s": round(tok_s, 2),
              **summarize(llm.collective_rpc(_collect)[0])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_costs.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for row in result["rows"]:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
