"""Is stock ``eagle3`` lossless at temperature 1 on the installed vLLM? Side by side
with ``eagle3_tree`` and plain decoding.

    python -m vllm_treespec.bench.stock_t1_lossless --draws 1000 --out DIR

Each engine (plain, stock ``eagle3`` k=3 with the shipped drafter, a fixed
``eagle3_tree`` of 16 nodes) draws ``--draws`` 4-token chat continuations of three
short prompts at T = 1, top-p 1, unseeded, in its own process, one after another.
Under losslessness every deterministic feature of a continuation has the same law
as plain decoding's, so each speculative engine is compared with plain decoding
by chi-squared homogeneity on the whole continuations and on their first 1, 2
and 3 tokens (outcomes seen < 10 times pooled). The first token is sampled at
prefill, before any speculation: it must match for every engine, so it is the
check that the harness itself is sound. Writes ``DIR/stock_t1.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

PROMPTS = ["Name one fruit.", "Pick a colour and say why you like it.", "Say a random animal."]
LENGTH = 4
ALPHA = 1e-3


def pvalue(a: list[tuple], b: list[tuple]) -> float:
    """``homogeneity_pvalue``; 1 where all outcomes pool into one column."""
    from vllm_treespec.bench.homogeneity import contingency_table, homogeneity_pvalue

    if len(contingency_table(Counter(a), Counter(b))[0]) < 2:
        return 1.0
    return float(homogeneity_pvalue(a, b))


def draw(method: str, draws: int) -> dict:
    """Run in a child process: ``draws`` continuations of each prompt."""
    from vllm import LLM, SamplingParams

    from vllm_treespec.assets import ensure_assets

    assets = ensure_assets()
    spec = {"none": None,
            "eagle3": {"method": "eagle3", "model": str(assets.drafter),
                       "num_speculative_tokens": 3},
            "eagle3_tree": {"method": "eagle3_tree", "model": str(assets.drafter),
                            "num_nodes": 16, "depth": 4, "top_k": 4, "adaptive": False}}[method]
    llm = LLM(model=str(assets.target), dtype="float32", max_model_len=1024, seed=0,
              max_num_seqs=128, compilation_config={"mode": 0}, speculative_config=spec)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=LENGTH, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([t for t in texts for _ in range(draws)], params)
    seqs = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": time.perf_counter() - t0,
            "draws": [seqs[i * draws:(i + 1) * draws] for i in range(len(PROMPTS))]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draws", type=int, default=1000, help="continuations per prompt")
    p.add_argument("--out", required=True)
    p.add_argument("--child", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        Path(args.child[1]).write_text(json.dumps(draw(args.child[0], args.draws)))
        return 0
    import vllm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
    runs = {}
    for method in ("none", "eagle3", "eagle3_tree"):
        path = out / f"{method}.draws.json"
        if path.exists():  # finished in an earlier sitting: a run resumes
            runs[method] = json.loads(path.read_text())
            continue
        subprocess.run([sys.executable, "-m", "vllm_treespec.bench.stock_t1_lossless",
                        "--draws", str(args.draws), "--out", str(out),
                        "--child", method, str(path)], check=True, env=env)
        runs[method] = json.loads(path.read_text())
    result = {"vllm": vllm.__version__, "draws": args.draws, "temperature": 1.0,
              "prompts": PROMPTS, "alpha": ALPHA, "command": " ".join(sys.argv),
              "seconds": {m: r["seconds"] for m, r in runs.items()}, "pvalues": {}}
    plain = runs["none"]["draws"]
    for method in ("eagle3", "eagle3_tree"):
        rows = []
        for prompt, a, b in zip(PROMPTS, plain, runs[method]["draws"]):
            row = {"prompt": prompt}
            for k in (1, 2, 3, LENGTH):
                row[f"first_{k}" if k < LENGTH else "whole"] = pvalue(
                    [tuple(s[:k]) for s in a], [tuple(s[:k]) for s in b])
            rows.append(row)
        result["pvalues"][method] = rows
        speculated = [v for r in rows for k, v in r.items() if k not in ("prompt", "first_1")]
        result[f"{method}_lossless"] = min(speculated) > ALPHA
    (out / "stock_t1.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
