"""Seconds of a compiled batch-1 target forward (+ logits) by row count.

    python benchmarks/results/stats-file-and-row-costs-avx512/forward_rows.py

One ``eagle3_tree`` engine; its runner's own ``_time_forward`` (the startup
sweep's timer, drafter excluded) for 1..16 rows, five rounds in one order, best
of 2 each, with oneDNN for every row count (the engine's own choice of
``W @ x^T`` for some row counts, in its startup log line, is set aside for the
sweep); prints min and median per row count.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def sweep(worker, rounds=5, sizes=range(1, 17)):
    from vllm_treespec.vllm_glue import cpu_linear

    runner = worker.model_runner
    chosen = sorted(cpu_linear._ROWS)
    cpu_linear.use_rows([])
    res = {}
    try:
        for _ in range(rounds):
            for n in sizes:
                res.setdefault(n, []).append(runner._time_forward(n, 2))
    finally:
        cpu_linear.use_rows(chosen)
    return {n: sorted(v) for n, v in res.items()}


if __name__ == "__main__":
    from interleaved_ab import batch1_engine

    llm = batch1_engine("eagle3_tree")
    for n, v in llm.collective_rpc(sweep)[0].items():
        print(n, "min %.1f med %.1f ms" % (1e3 * v[0], 1e3 * v[len(v) // 2]))
