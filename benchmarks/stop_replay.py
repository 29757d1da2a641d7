"""Replay a chain's draft probabilities: what stopping drafting early would gain.

Runs two batch-1 engines in turn with a one-wide tree and the adaptive budget
off (the greedy chain of ``--depth`` drafts, then of 2, the same drafts as
stock ``eagle3``), each tracing its verify steps (``trace_dir``: every node's
draft probability and the accepted length). The median step period at the two
depths prices a step as ``a + b * depth``. Then, on the deep trace's steps, it
replays:

* a fixed chain of k drafts, for every k up to ``--depth``: the step accepts
  ``min(accepted, k)`` drafts at the price of depth k;
* stopping at the first draft whose path probability is below ``tau`` (the
  rule of ``AdaptiveBudget.level_pays``, with ``tau`` the level's cost times the
  step's rate), capped at every depth: a step stops at depth l, accepts
  ``min(accepted, l)`` and pays for depth l.

A replay, not a measurement: it keeps the deep run's step boundaries (a real
run with other stops would see other contexts) and prices depth linearly.

    python benchmarks/stop_replay.py --prompts 24 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

TAUS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def record(method: str, trace: Path, prompts: int, max_tokens: int) -> float:
    """Run one engine over the first ``prompts`` chat turns, tracing to ``trace``."""
    from interleaved_ab import batch1_engine, greedy_first_turns_tok_s

    os.environ["VLLM_TREESPEC_TRACE_DIR"] = str(trace)
    llm = batch1_engine(method)
    tok_s = greedy_first_turns_tok_s(llm, prompts, max_tokens)
    del llm
    return tok_s


def load(trace: Path) -> tuple[list[tuple[list[float], int]], float]:
    """(per step: draft probabilities along the chain, accepted drafts), and the
    median period between consecutive verify steps in ms."""
    steps, times = [], []
    for path in sorted(trace.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            req = rec["requests"][0]
            times.append(rec["t"])
            if rec["batch"] == 1 and req["nodes"]:
                steps.append((req["draft_probs"], req["accepted"]))
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:]) if 0 < b - a < 1.0]
    return steps, statistics.median(gaps)


def replay(steps, depth: int, a_ms: float, b_ms: float) -> dict:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=24, help="first N pangu240 first turns")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    sys.path.insert(0, str(Path(__file__).parent))
    depths = {"deep": args.depth, "short": 2}
    tok_s, periods, steps = {}, {}, {}
    for name, d in depths.items():
        trace = args.out / f"trace-chain{d}"
        if not any(trace.glob("steps-*.jsonl")):  # a rerun replays what is there
            tok_s[name] = round(record(f"eagle3_tree:top_k=1,num_nodes={d},depth={d},"
                                       "adaptive=false", trace, args.prompts, args.max_tokens), 2)
        steps[name], periods[name] = load(trace)
    b_ms = (periods["deep"] - periods["short"]) / (args.depth - 2)
    a_ms = periods["short"] - 2 * b_ms
    result = {"command": "python benchmarks/stop_replay.py " + " ".join(argv or sys.argv[1:]),
              "engine_tok_s": tok_s, "steps": len(steps["deep"]),
              "period_ms": {k: round(v, 2) for k, v in periods.items()},
              "step_ms": {"a": round(a_ms, 2), "b_per_depth": round(b_ms, 3)},
              "accepted_at_least": [round(sum(acc >= d for _, acc in steps["deep"])
                                          / len(steps["deep"]), 3)
                                    for d in range(1, args.depth + 1)],
              **replay(steps["deep"], args.depth, a_ms, b_ms)}
    (args.out / "stop_replay.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("stop",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
