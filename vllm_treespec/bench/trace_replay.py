"""Replay a batch-1 engine's traced verify steps: what another drafting rule
would have accepted on the same steps.

Each replay runs batch-1 engines with the adaptive budget off, tracing their verify
steps (``trace_dir``: every node's parent and path draft probability, the accepted
length and path), then replays the traces offline. A rerun with the same ``--out``
replays the traces already there. A replay, not a measurement: it keeps the traced
run's step boundaries (a real run with other rules would see other contexts).

``stop`` (when to stop drafting): two engines in turn with a one-wide tree, the
greedy chain of ``--depth`` drafts, then of 2 (the same drafts as stock ``eagle3``).
The median step period at the two depths prices a step as ``a + b * depth``; then,
on the deep trace's steps, it replays

* a fixed chain of k drafts, for every k up to ``--depth``: the step accepts
  ``min(accepted, k)`` drafts at the price of depth k;
* stopping at the first draft whose path probability is below ``tau`` (the rule of
  ``AdaptiveBudget.level_pays``, with ``tau`` the level's cost times the step's
  rate), capped at every depth: a step stops at depth l, accepts ``min(accepted,
  l)`` and pays for depth l (depth priced linearly).

``selection`` (which M drafts to verify at an equal budget): one engine with a large
fixed tree (``--pool`` nodes, depth ``--depth``). In greedy decoding a node is right
when its path is a prefix of the target's own continuation, and the trace says which
pool nodes were: the accepted path. So any selection of M of the pool's nodes (closed
under ancestors) would have accepted exactly the deepest selected node on that path.
It compares, on the same steps:

* ``eagle2``: the M nodes of highest path draft probability (what ``eagle3_tree``
  selects by default);
* ``depth x g``: path draft probability times ``g`` per level (g < 1 prefers bushy
  trees, g > 1 deep ones; a power of the probabilities would not change the order);
  ``eagle3_tree``'s ``depth_weight`` g, which also ranks each level's frontier this way;
* ``calibrated``: path scores from each node's measured acceptance given its parent
  was right, by depth and conditional draft probability, fitted on the other half of
  the requests (two-fold, split by request).

A selection can only use nodes the pool kept. ``eagle2``'s M nodes are always in the
pool (they are its best M); another rule's result is a lower bound where it would
have picked nodes the pool dropped. The drafter's greedy chain is not replayed: the
pool holds a chain of 8 whole in only a fraction of the steps (``chain_in_pool``), so
a chain's acceptance comes from a live run.

    python -m vllm_treespec.bench.trace_replay stop --prompts 24 --out DIR
    python -m vllm_treespec.bench.trace_replay selection --prompts 40 --out DIR
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

TAUS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


# ---- the driver: trace an engine, read its steps ----------------------------------------

def record(method: str, trace: Path, prompts: int, max_tokens: int) -> float:
    """Run one engine over the first ``prompts`` chat turns, tracing to ``trace``."""
    from vllm_treespec.bench.interleaved_ab import batch1_engine, greedy_first_turns_tok_s

    os.environ["VLLM_TREESPEC_TRACE_DIR"] = str(trace)
    llm = batch1_engine(method)
    tok_s = greedy_first_turns_tok_s(llm, prompts, max_tokens)
    del llm
    return tok_s


def traced(method: str, trace: Path, args) -> float | None:
    """Trace ``method`` to ``trace`` unless a trace is there (a rerun replays it):
    the engine's tok/s, or None."""
    if any(trace.glob("steps-*.jsonl")):
        return None
    return round(record(method, trace, args.prompts, args.max_tokens), 2)


def trace_records(trace: Path):
    """Every traced verify step of ``trace``, in order."""
    for path in sorted(trace.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            yield json.loads(line)


# ---- stop: when to stop drafting ----------------------------------------------------------

def chain_steps(trace: Path) -> tuple[list[tuple[list[float], int]], float]:
    """(per step: draft probabilities along the chain, accepted drafts), and the
    median period between consecutive verify steps in ms."""
    steps, times = [], []
    for rec in trace_records(trace):
        req = rec["requests"][0]
        times.append(rec["t"])
        if rec["batch"] == 1 and req["nodes"]:
            steps.append((req["draft_probs"], req["accepted"]))
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:]) if 0 < b - a < 1.0]
    return steps, statistics.median(gaps)


def replay_stops(steps, depth: int, a_ms: float, b_ms: float) -> dict:
    def run(stop_at) -> dict:
        tokens = ms = 0.0
        for probs, accepted in steps:
            l = stop_at(probs)
            tokens += 1 + min(accepted, l)
            ms += a_ms + b_ms * l
        return {"tok_s": round(1e3 * tokens / ms, 2),
                "tokens_per_step": round(tokens / len(steps), 3)}

    def first_below(tau: float, cap: int):
        return lambda probs: next((l for l in range(1, cap + 1) if probs[l - 1] < tau), cap)

    fixed = {k: run(lambda probs, k=k: k) for k in range(1, depth + 1)}
    stops = {cap: {tau: run(first_below(tau, cap)) for tau in TAUS} for cap in range(2, depth + 1)}
    best_k = max(fixed, key=lambda k: fixed[k]["tok_s"])
    best = max(((cap, tau) for cap in stops for tau in TAUS),
               key=lambda ct: stops[ct[0]][ct[1]]["tok_s"])
    return {"fixed": fixed, "stop": stops, "best_fixed_k": best_k,
            "best_stop": {"cap": best[0], "tau": best[1],
                          "vs_best_fixed": round(stops[best[0]][best[1]]["tok_s"]
                                                 / fixed[best_k]["tok_s"], 3)}}


def stop(args) -> dict:
    depths = {"deep": args.depth, "short": 2}
    tok_s, periods, steps = {}, {}, {}
    for name, d in depths.items():
        trace = args.out / f"trace-chain{d}"
        tok_s[name] = traced(f"eagle3_tree:top_k=1,num_nodes={d},depth={d},adaptive=false",
                             trace, args)
        steps[name], periods[name] = chain_steps(trace)
    b_ms = (periods["deep"] - periods["short"]) / (args.depth - 2)
    a_ms = periods["short"] - 2 * b_ms
    return {"engine_tok_s": {k: v for k, v in tok_s.items() if v is not None},
            "steps": len(steps["deep"]),
            "period_ms": {k: round(v, 2) for k, v in periods.items()},
            "step_ms": {"a": round(a_ms, 2), "b_per_depth": round(b_ms, 3)},
            "accepted_at_least": [round(sum(acc >= d for _, acc in steps["deep"])
                                        / len(steps["deep"]), 3)
                                  for d in range(1, args.depth + 1)],
            **replay_stops(steps["deep"], args.depth, a_ms, b_ms)}


# ---- selection: which M drafts to verify --------------------------------------------------

P_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
DEPTH_FACTORS = (0.7, 0.85, 1.2, 1.5)


class Step:
    """One request's tree in one verify step: per node (1..n) its parent,
    children, depth, conditional draft probability and whether it was right."""

    def __init__(self, req: dict):
        parents, q = req["parents"], [1.0] + list(req["draft_probs"])
        n = len(parents) - 1
        self.parent = parents
        self.depth = [0] * (n + 1)
        self.cond = [1.0] * (n + 1)
        self.children: dict[int, list[int]] = defaultdict(list)
        for i in range(1, n + 1):
            p = parents[i]
            self.children[p].append(i)
            self.depth[i] = self.depth[p] + 1
            self.cond[i] = min(1.0, q[i] / q[p]) if q[p] > 0 else 0.0
        self.right = set(req["path"])
        self.request = req["id"]

    def nodes(self) -> range:
        return range(1, len(self.parent))


def select(step: Step, m: int, conditional) -> set[int]:
    """The m nodes of highest path score (product of ``conditional``), closed
    under ancestors: best first among the children of what is chosen (the top m
    when scores fall along paths; ties go shallow)."""
    score = {0: 1.0}
    heap: list[tuple[float, int, int]] = []

    def push(parent: int) -> None:
        for i in step.children[parent]:
            score[i] = score[parent] * conditional(step, i)
            heapq.heappush(heap, (-score[i], step.depth[i], i))

    chosen: set[int] = set()
    push(0)
    while heap and len(chosen) < m:
        i = heapq.heappop(heap)[2]
        chosen.add(i)
        push(i)
    return chosen


def chain_whole(step: Step, m: int) -> bool:
    """Whether the pool holds the drafter's greedy chain (top-1 child at each
    level) to depth m."""
    node = 0
    for _ in range(m):
        if not step.children[node]:
            return False
        node = max(step.children[node], key=lambda i: step.cond[i])
    return True


def accepted(step: Step, chosen: set[int]) -> int:
    return max((step.depth[i] for i in chosen & step.right), default=0)


def bucket(step: Step, i: int) -> tuple[int, int]:
    return min(step.depth[i], 4), sum(step.cond[i] >= e for e in P_EDGES)


def fit(steps: list[Step]):
    """P(right | parent right) per (depth group, probability bucket), smoothed
    toward the bucket's own mean draft probability (a prior worth 4 nodes)."""
    right, seen, mass = defaultdict(float), defaultdict(float), defaultdict(float)
    for s in steps:
        for i in s.nodes():
            if s.parent[i] == 0 or s.parent[i] in s.right:
                b = bucket(s, i)
                seen[b] += 1
                right[b] += i in s.right
                mass[b] += s.cond[i]
    table = {b: (right[b] + 4 * mass[b] / seen[b]) / (seen[b] + 4) for b in seen}
    return lambda s, i: table.get(bucket(s, i), s.cond[i])


def replay_selection(steps: list[Step], budgets: list[int]) -> dict:
    order = {r: n for n, r in enumerate(dict.fromkeys(s.request for s in steps))}
    folds = [[s for s in steps if order[s.request] % 2 == f] for f in (0, 1)]
    rules = {"eagle2": lambda s, i: s.cond[i]}
    rules.update({f"depth x {g}": (lambda s, i, g=g: s.cond[i] * g) for g in DEPTH_FACTORS})
    fitted = [fit(folds[1]), fit(folds[0])]  # each fold scored by the other's table
    out = {}
    for m in budgets:
        row = {}
        for name, rule in rules.items():
            row[name] = sum(1 + accepted(s, select(s, m, rule)) for s in steps)
        row["calibrated"] = sum(1 + accepted(s, select(s, m, fitted[f]))
                                for f in (0, 1) for s in folds[f])
        out[m] = {k: round(v / len(steps), 3) for k, v in row.items()}
    return out


def selection(args) -> dict:
    trace = args.out / f"trace-pool{args.pool}-depth{args.depth}"
    tok_s = traced(f"eagle3_tree:num_nodes={args.pool},depth={args.depth},adaptive=false",
                   trace, args)
    steps = [Step(req) for rec in trace_records(trace) for req in rec["requests"]
             if req["nodes"] and req["draft_probs"]]
    budgets = [int(b) for b in args.budgets.split(",")]
    return {"engine_tok_s": tok_s, "steps": len(steps),
            "pool_accept_len": round(sum(1 + accepted(s, set(s.nodes())) for s in steps)
                                     / len(steps), 3),
            "chain_in_pool": {m: round(sum(chain_whole(s, m) for s in steps)
                                       / len(steps), 3) for m in budgets if m <= args.depth},
            "accept_len": replay_selection(steps, budgets)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="replay", required=True)
    for name, prompts, depth, about in (
            ("stop", 24, 6, "fixed chain lengths against stopping under a probability"),
            ("selection", 40, 8, "which M nodes of a large traced tree to verify")):
        s = sub.add_parser(name, help=about, description=about)
        s.add_argument("--prompts", type=int, default=prompts,
                       help="first N pangu240 first turns")
        s.add_argument("--max-tokens", type=int, default=256)
        s.add_argument("--depth", type=int, default=depth)
        s.add_argument("--out", type=Path, required=True)
        if name == "selection":
            s.add_argument("--pool", type=int, default=64, help="nodes of the traced tree")
            s.add_argument("--budgets", default="4,8,16")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    command = "python -m vllm_treespec.bench.trace_replay " + " ".join(argv or sys.argv[1:])
    result = {"command": command,
              **{"stop": stop, "selection": selection}[args.replay](args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.replay}_replay.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "stop"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
