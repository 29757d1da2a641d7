"""Interleaved A/B (code of 60ec3ec / 6b87a2e only, where the budget has
``observe_cycle``): the cycle-priced stop rule against the same engine with
``observe_cycle`` disabled (the table-priced rule), named ``eagle3_tree:adaptive=true``.

    python benchmarks/results/cycle-priced-stops-withdrawn-avx512/inprocess_ab.py "eagle3:k=4;eagle3_tree;eagle3_tree:adaptive=true" 8
"""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

def _disable(worker):
    worker.model_runner.tree_policy.observe_cycle = lambda *a, **k: None
    return True

def _state(worker):
    p = worker.model_runner.tree_policy
    return {"levels_at": [round(x, 2) for x in p.levels_at], "kappa": p.kappa,
            "cycles": {b: [f.weight, f.rate(), f.token_price()] for b, f in p.cycles.items()}}

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import interleaved_ab as ia
    from vllm_treespec.commands.cpu_openmp import preload_intel_openmp
    preload_intel_openmp()
    from vllm import SamplingParams
    from vllm_treespec.bench import pangu240
    methods = sys.argv[1].split(";")
    n = int(sys.argv[2])
    engines = {m: ia.batch1_engine(m) for m in methods}
    for m, llm in engines.items():
        if m.endswith("adaptive=true"):
            llm.collective_rpc(_disable)
    prompts = ia.chat_prompts(next(iter(engines.values())).get_tokenizer(), pangu240.first_turns(n))
    greedy = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:1], greedy, use_tqdm=False)
        llm.collective_rpc(ia._install)
    wall = dict.fromkeys(methods, 0.0)
    per = {m: [] for m in methods}
    texts = {m: [] for m in methods}
    for prompt in prompts:
        for m, llm in engines.items():
            t = time.perf_counter()
            o = llm.generate([prompt], greedy, use_tqdm=False)
            dt = time.perf_counter() - t
            wall[m] += dt; per[m].append(256 / dt); texts[m].append(o[0].outputs[0].token_ids)
    res = {}
    base = methods[0]
    for m, llm in engines.items():
        steps, totals = llm.collective_rpc(ia._collect)[0]
        res[m] = {"tok_s": round(n * 256 / wall[m], 2), "vs_first": round(wall[base] / wall[m], 3),
                  "same_tokens": sum(a == b for a, b in zip(texts[m], texts[base])),
                  **ia._split(steps), "totals": totals}
        if "tree" in m:
            res[m]["state"] = llm.collective_rpc(_state)[0]
    print("RESULT", json.dumps(res, indent=1))
