"""The worker's stats file on a disk-backed /tmp or on /dev/shm, in one engine.

    python benchmarks/results/stats-file-and-row-costs-avx512/stats_write_ab.py 8

One batch-1 ``eagle3_tree`` engine (as ``benchmarks/interleaved_ab.py`` builds it);
each of the first N chat-formatted pangu240 turns is decoded twice, greedy, 256
tokens, once with the worker's stats file on /tmp and once on /dev/shm (the order
alternating), so engine-to-engine spread cannot enter. Prints tok/s per setting.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a local function
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def set_path(worker, path):
    worker.model_runner.tree_metrics.stats.path = Path(path)
    return True


if __name__ == "__main__":
    from vllm import SamplingParams

    from interleaved_ab import batch1_engine, chat_prompts
    from vllm_treespec.bench import pangu240

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    llm = batch1_engine("eagle3_tree")
    texts = chat_prompts(llm.get_tokenizer(), pangu240.first_turns(n))
    paths = {"disk": tempfile.mkdtemp(dir="/tmp") + "/engine-0.json",
             "shm": tempfile.mkdtemp(dir="/dev/shm") + "/engine-0.json"}
    params = SamplingParams(temperature=0, max_tokens=256)
    llm.generate(texts[:1], params)  # warm-up
    totals = {k: [0, 0.0] for k in paths}
    for i, text in enumerate(texts):
        for key in (["disk", "shm"] if i % 2 == 0 else ["shm", "disk"]):
            llm.collective_rpc(set_path, args=(paths[key],))
            t0 = time.perf_counter()
            out = llm.generate([text], params, use_tqdm=False)
            totals[key][1] += time.perf_counter() - t0
            totals[key][0] += len(out[0].outputs[0].token_ids)
        print(i, {k: round(v[0] / v[1], 2) for k, v in totals.items()}, flush=True)
    result = {k: round(v[0] / v[1], 3) for k, v in totals.items()}
    result["shm_vs_disk"] = round(result["shm"] / result["disk"], 4)
    print(json.dumps(result))
