"""`vllm-treespec demo`: tree speculation on your machine, in a few minutes.

Prepares (or reuses) the embedded SmolLM2-135M-Instruct target and its EAGLE-3
drafter, serves them with ``eagle3_tree`` on the CPU through the OpenAI API,
asks a handful of questions and prints the answers, then runs the same prompts
without speculation and prints the speeds side by side with the acceptance
length and where the per-step trace was written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "Write a Python function that returns the largest element of a list.",
    "Explain in two sentences what a hash table is.",
    "Give three tips for staying focused while studying.",
    "Write a short poem about the moon.",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-treespec demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default=None, help="directory for logs and traces")
    p.add_argument("--model", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--tree", default='{"num_nodes": 24, "depth": 5, "top_k": 6}',
                   help="JSON of eagle3_tree settings")
    args = p.parse_args(argv)

    import json

    from vllm_treespec.bench.driver import Driver
    from vllm_treespec.bench.pangu240 import Turn
    from vllm_treespec.bench.server import Server

    say = lambda msg="": print(msg, flush=True)  # noqa: E731
    if args.model is None or args.drafter is None:
        from vllm_treespec.assets import ensure_assets

        say("[demo] preparing the embedded models (first run: about a minute)")
        assets = ensure_assets()
        args.model = args.model or str(assets.target)
        args.drafter = args.drafter or str(assets.drafter)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-treespec-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    trace_dir = out / "trace"
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
               "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")}
    serve_args = ["--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
                  "--max-num-seqs", "4", "--compilation-config", '{"mode": 0}']
    tree = {"method": "eagle3_tree", "model": args.drafter, "trace_dir": str(trace_dir),
            **json.loads(args.tree)}
    turns = [Turn(f"demo/{i}", "demo", [{"role": "user", "content": q}])
             for i, q in enumerate(PROMPTS)]
    say(f"[demo] target  {args.model}\n[demo] drafter {args.drafter}")
    say(f"[demo] serving with eagle3_tree {json.dumps(json.loads(args.tree))} on the CPU ...")

    results = {}
    for label, spec in (("eagle3_tree", tree), ("none", None)):
        with Server(args.model, serve_args, spec, out / f"server-{label}.log", env=env) as srv:
            drv = Driver(srv, args.max_tokens)
            drv.run_turn(Turn("warmup", "demo", [{"role": "user", "content": "Hi!"}]))
            results[label] = drv.run_sequential(turns)
        if label == "eagle3_tree":
            for q, r in zip(PROMPTS, results[label]):
                say(f"\n>>> {q}\n{r.text.strip()}")
            say("\n[demo] now the same prompts without speculation ...")

    tree_res, plain = results["eagle3_tree"], results["none"]
    tok = lambda rs: sum(r.output_tokens for r in rs) / sum(r.e2e_s for r in rs)  # noqa: E731
    accepted = [r.accept_len for r in tree_res if r.accept_len is not None]
    same = all(a.text == b.text for a, b in zip(tree_res, plain))
    say("\nmethod         tok/s    mean acceptance length")
    say(f"none        {tok(plain):8.1f}    –")
    say(f"eagle3_tree {tok(tree_res):8.1f}    "
        + (f"{sum(accepted) / len(accepted):.2f}" if accepted else "–")
        + f"    ({tok(tree_res) / tok(plain):.2f}x)")
    if not accepted:
        say("(no tree was verified: the adaptive budget measured that speculation does not pay "
            "with this drafter on this machine; add \"adaptive\": false to --tree to force trees)")
    say(f"\ngreedy answers identical to decoding without speculation: {same}")
    steps = sorted(trace_dir.glob("steps-*.jsonl"))
    say(f"per-step trace: {steps[0] if steps else trace_dir}  (manifest: "
        f"{trace_dir / 'manifest.json'})\nserver logs: {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
