"""Run one vLLM engine configuration in its own process and dump the results.

    python -m tests.integration.engine_run SPEC.json OUT.json

SPEC: {"engine": {LLM kwargs}, "prompts": [[token ids]...], "sampling": {...},
       "batch": "all" | 1, "oracle": {"reference": {...}, "seed": int} | null,
       "n_per_prompt": int}
OUT:  {"outputs": [[token ids]...] (per prompt, per sample), "tree": metrics | null,
       "seconds": float}

Each engine runs in a fresh process so tests never share vLLM global state.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    from tests.integration import oracle

    spec = json.loads(open(spec_path).read())
    llm = LLM(**spec["engine"])
    tree_mode = (spec["engine"].get("speculative_config") or {}).get("method") == "eagle3_tree"
    if spec.get("oracle") and tree_mode:
        llm.collective_rpc(oracle.install, args=(spec["oracle"]["reference"],
                                                 spec["oracle"].get("seed", 0)))
    sampling = SamplingParams(**spec["sampling"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t0 = time.perf_counter()
    results = []
    if spec.get("batch", "all") == 1:
        for p in prompts:
            results += llm.generate([p], sampling, use_tqdm=False)
    else:
        results = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outputs = [[list(c.token_ids) for c in r.outputs] for r in results]
    tree = llm.collective_rpc(oracle.tree_metrics)[0] if tree_mode else None
    with open(out_path, "w") as f:
        json.dump({"outputs": outputs, "tree": tree, "seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
