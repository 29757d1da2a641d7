"""Where an engine's resident memory goes across identical load passes: live
objects, or free heap memory the C allocator keeps.

The soak (``vllm-treespec soak --tree-passes N``) sees the model worker's
resident memory climb pass after pass, plain vLLM's and more so a tree
server's. This runs one engine in this process (so its Python objects can be
counted), warms it with 64 requests, then sends the same seeded mix of prompts
(1 to 600 tokens, ``max_tokens`` 1 to 256, greedy and sampled) ``--passes``
times at up to 64 in flight with a small KV cache (so requests are preempted).
After the warm-up and after each pass it reports resident memory before and
after glibc's ``malloc_trim(0)`` (which hands free heap memory back to the
OS), the bytes of live torch tensors reachable from Python, and which Python
object types grew. Memory that ``malloc_trim`` returns was free: retention,
not a leak. (A tree worker trims by itself when its engine goes idle, see
``vllm_glue/host_heap``; here that happens on the engine's next step, at the
start of the next pass, so the figures before the trim are without it and those
after it are what a served tree worker keeps.)

    python -m vllm_treespec.bench.memory_retention --method fixed --requests 150 --passes 2

Linux with glibc only (``malloc_trim``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import time

FIXED_TREE = {"validate_invariants": True, "adaptive": False, "num_nodes": 8, "depth": 3,
              "top_k": 2}  # the soak's fixed tree


def census():
    """(object count by type, bytes of distinct tensor storages reachable from Python)."""
    import torch

    gc.collect()
    objects = gc.get_objects()
    counts = collections.Counter(type(o).__name__ for o in objects)
    seen, total = set(), 0
    for o in objects:
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return counts, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("plain", "fixed"), default="fixed")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_treespec.assets import ensure_assets
    from vllm_treespec.bench import pangu240
    from vllm_treespec.vllm_glue import host_heap

    assets = ensure_assets()
    spec = None if args.method == "plain" else {
        "method": "eagle3_tree", "model": str(assets.drafter), **FIXED_TREE}
    llm = LLM(model=str(assets.target), dtype="float32", max_model_len=1024, seed=0,
              block_size=128, max_num_seqs=64, num_gpu_blocks_override=64,
              speculative_config=spec, compilation_config={"mode": 0})
    texts = [t.messages[-1]["content"] for t in pangu240.build_turns() if t.depends_on is None]
    pool = AutoTokenizer.from_pretrained(assets.target)("\n\n".join(texts))["input_ids"]
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(args.requests):
        length = rng.choice([1, 8, 32, 100, 300, 600])
        start = rng.randrange(0, len(pool) - length)
        temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
        prompts.append(TokensPrompt(prompt_token_ids=pool[start:start + length]))
        params.append(SamplingParams(max_tokens=rng.choice([1, 16, 64, 128, 256]),
                                     temperature=temperature,
                                     top_p=0.9 if temperature else 1.0,
                                     seed=i if temperature else None))

    def measure(label: str, seconds: float | None, before_counts) -> dict:
        counts, tensor_bytes = census()
        trim = host_heap.trim_heap()
        if trim is None:
            raise SystemExit("memory_retention needs glibc's malloc_trim")
        rss, trimmed = trim.resident_before, trim.resident_after
        grew = {} if before_counts is None else {
            k: counts[k] - before_counts.get(k, 0) for k in counts
            if counts[k] - before_counts.get(k, 0) > 50}
        row = {"after": label, "seconds": seconds, "rss_mb": rss >> 20,
               "rss_after_trim_mb": trimmed >> 20, "python_tensors_mb": tensor_bytes >> 20,
               "object_types_grown": dict(sorted(grew.items(), key=lambda kv: -kv[1])[:15])}
        print(json.dumps(row), flush=True)
        return row | {"_counts": counts}

    llm.generate(prompts[:64], params[:64], use_tqdm=False)
    rows = [measure("warm-up", None, None)]
    for n in range(args.passes):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rows.append(measure(f"pass {n + 1}", round(time.perf_counter() - t0, 1),
                            rows[-1]["_counts"]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"memory_retention_{args.method}.json"), "w") as f:
            json.dump({"args": vars(args),
                       "rows": [{k: v for k, v in r.items() if k != "_counts"} for r in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
