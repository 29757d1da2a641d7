"""Replay node selection at an equal verify budget: which M drafts to verify.

Runs one batch-1 engine with a large fixed tree (``--pool`` nodes, depth
``--depth``, adaptive off), tracing its verify steps (``trace_dir``: every
node's parent and path draft probability, and the accepted path). In greedy
decoding a node is right when its path is a prefix of the target's own
continuation, and the trace says which pool nodes were: the accepted path. So
any selection of M of the pool's nodes (closed under ancestors) would have
accepted exactly the deepest selected node on that path. The replay compares,
on the same steps:

* ``eagle2``: the M nodes of highest path draft probability (what
  ``eagle3_tree`` selects by default);
* ``depth x g``: path draft probability times ``g`` per level (g < 1 prefers
  bushy trees, g > 1 deep ones; a power of the probabilities would not change
  the order); ``eagle3_tree``'s ``depth_weight`` g, which also ranks each
  level's frontier this way;
* ``calibrated``: path scores from each node's measured acceptance given its
  parent was right, by depth and conditional draft probability, fitted on
  the other half of the requests (two-fold, split by request).

A replay, not a measurement: it keeps the pool run's step boundaries, and a
selection can only use nodes the pool kept. ``eagle2``'s M nodes are always in
the pool (they are its best M); another rule's result is a lower bound where
it would have picked nodes the pool dropped. The drafter's greedy chain is not
replayed: the pool holds a chain of 8 whole in only a fraction of the steps
(``chain_in_pool``), so a chain's acceptance comes from a live run.

    python benchmarks/selection_replay.py --prompts 40 --out DIR
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

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


def load(trace: Path) -> list[Step]:
    steps = []
    for path in sorted(trace.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for req in rec["requests"]:
                if req["nodes"] and req["draft_probs"]:
                    steps.append(Step(req))
    return steps


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


def replay(steps: list[Step], budgets: list[int]) -> dict:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40, help="first N pangu240 first turns")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--pool", type=int, default=64, help="nodes of the traced tree")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--budgets", default="4,8,16")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    sys.path.insert(0, str(Path(__file__).parent))
    trace = args.out / f"trace-pool{args.pool}-depth{args.depth}"
    tok_s = None
    if not any(trace.glob("steps-*.jsonl")):  # a rerun replays what is there
        from stop_replay import record

        tok_s = round(record(f"eagle3_tree:num_nodes={args.pool},depth={args.depth},"
                             "adaptive=false", trace, args.prompts, args.max_tokens), 2)
    steps = load(trace)
    budgets = [int(b) for b in args.budgets.split(",")]
    result = {"command": "python benchmarks/selection_replay.py " + " ".join(argv or sys.argv[1:]),
              "engine_tok_s": tok_s, "steps": len(steps),
              "pool_accept_len": round(sum(1 + accepted(s, set(s.nodes())) for s in steps)
                                       / len(steps), 3),
              "chain_in_pool": {m: round(sum(chain_whole(s, m) for s in steps)
                                         / len(steps), 3) for m in budgets if m <= args.depth},
              "accept_len": replay(steps, budgets)}
    (args.out / "selection_replay.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
