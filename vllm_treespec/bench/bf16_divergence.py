"""How often greedy `eagle3_tree` in bf16 differs from plain bf16 decoding.

Token identity with plain decoding is proven in fp32 (tests/integration). In bf16 a
verify step computes the same positions in a different batch shape than plain
decoding does (a tree of nodes instead of one token), and bf16 matmuls round
differently per shape, so near-ties in the argmax can flip. This measures how
often that happens, next to what vLLM itself does: plain bf16 decoding at batch 16
against plain bf16 at batch 1 (the same prompts, only the batching differs).

    python -m vllm_treespec.bench.bf16_divergence --prompts 40 --max-tokens 128 --out DIR

Writes DIR/bf16_divergence.json: per run, the share of prompts whose text differs
from plain bf16 at batch 1, and where the first differing token is.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path


def _generate(target: str, prompts: list[str], max_tokens: int, max_num_seqs: int,
              spec: dict | None, dtype: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype=dtype, max_model_len=2048, max_num_seqs=max_num_seqs,
              seed=0, speculative_config=spec, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return tokens


def _compare(ref: list[list[int]], run: list[list[int]]) -> dict:
    first = []
    for a, b in zip(ref, run):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                 None if len(a) == len(b) else min(len(a), len(b)))
        if n is not None:
            first.append(n)
    return {"differing": len(first), "prompts": len(ref), "share": len(first) / len(ref),
            "first_difference_at": sorted(first)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm_treespec.assets import ensure_assets
    from vllm_treespec.bench import pangu240

    assets = ensure_assets()
    turns = [t for t in pangu240.build_turns(2 * args.prompts) if t.depends_on is None]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets.target))
    prompts = [tok.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True)
               for t in turns[: args.prompts]]
    tree = {"method": "eagle3_tree", "model": str(assets.drafter)}
    runs = {"plain bf16, batch 16": (16, None, "bfloat16"),
            "eagle3_tree bf16, batch 1": (1, tree, "bfloat16"),
            "eagle3_tree bf16, batch 16": (16, tree, "bfloat16")}
    ref = _generate(str(assets.target), prompts, args.max_tokens, 1, None, "bfloat16")
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens,
              "reference": "plain bf16, batch 1", "runs": {}}
    for name, (seqs, spec, dtype) in runs.items():
        result["runs"][name] = _compare(ref, _generate(str(assets.target), prompts,
                                                       args.max_tokens, seqs, spec, dtype))
        print(name, json.dumps(result["runs"][name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16_divergence.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
