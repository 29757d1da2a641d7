"""Where a decode step's time goes, per method: cProfile over one in-process engine.

    python -m vllm_treespec.bench.step_profile --methods "eagle3:k=3,eagle3_tree" --out DIR

Each method runs alone in a fresh process (engine core and worker in the same
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profile sees the worker):
one warm-up prompt, then ``--prompts`` chat-formatted pangu240 first turns,
greedy unless ``--temperature`` (and ``--top-p``), ``--max-tokens`` each, one at
a time, or with ``--batch B`` in rounds of B prompts decoded together, as B
concurrent clients keep a server's batch full (sampled runs seed each prompt, so methods meet the same requests; with
``--unseeded`` they do not, as a served benchmark's requests: seeded tree requests
take another sampling path, vLLM's own top-p and per-position noise). Written per method:
``LABEL.pstats`` (the method's label as ``vllm-treespec bench`` names its files;
open with ``python -m pstats``) and, in ``step_profile.json``, the wall time and
milliseconds per engine step of the runner's forward, sampling, drafting, the
tree's chain-split verify and the native attention kernel. cProfile adds its own
cost to every Python call, so compare methods within one run; absolute tok/s are
lower than unprofiled ones. OpenMP threads are bound to cores 0-1 unless
``VLLM_CPU_OMP_THREADS_BIND`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# (file, function) -> row name; cumulative time per engine step. Where several
# functions match (nested closures, a model's inner forwards) the outermost, the
# one with the largest cumulative time, is the one meant.
PARTS = {
    ("gpu_model_runner.py", "execute_model"): "execute_model",
    ("gpu_model_runner.py", "_model_forward"): "target_forward",
    ("gpu_model_runner.py", "sample_tokens"): "sample_tokens",
    ("gpu_model_runner.py", "propose_draft_token_ids"): "propose",
    ("llama_eagle3.py", "forward"): "drafter_forward",
    ("proposer.py", "draft_vocab_logprobs"): "draft_logprobs",
    ("tree_sampler.py", "sample_with_trees"): "tree_sampling",
    # NodeLogits[trees, nodes]: the node rows a step processes (mask, penalties)
    ("engine/accept.py", "__getitem__"): "tree_node_logits",
    ("engine/accept.py", "node_probs"): "tree_node_probs",
    ("tree/accept.py", "stochastic_accept"): "tree_stochastic_accept",
    ("cpu_attention.py", "_verify_chains"): "tree_verify_chains",
    ("~", "<built-in method torch._ops._C.cpu_attention_with_kv_cache>"): "attention_kernel",
}


def summarize(stats_path: Path) -> dict:
    import pstats

    stats = pstats.Stats(str(stats_path)).stats
    steps = max((nc for (f, _, fn), (_, nc, *_rest) in stats.items()
                 if fn == "step" and f.endswith("/llm_engine.py")), default=0)
    if not steps:
        raise SystemExit(f"step_profile: no LLMEngine.step in {stats_path}")
    row = {"engine_steps": steps}
    for (suffix, name), key in PARTS.items():
        cum = [ct for (f, _, fn), (_, _, _, ct, _) in stats.items()
               if fn == name and (f == suffix or f.endswith("/" + suffix))]
        row[f"{key}_ms_per_step"] = round(1e3 * max(cum) / steps, 2) if cum else None
    return row


def profile_one(method: str, prompts: int, max_tokens: int, stats_path: Path,
                temperature: float = 0.0, top_p: float | None = None,
                seeded: bool = True, batch: int = 1) -> dict:
    import cProfile
    import time

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm_treespec.cpu_openmp import preload_intel_openmp

    preload_intel_openmp()  # as `vllm-treespec serve` does
    from vllm import SamplingParams

    from vllm_treespec.bench import pangu240
    from vllm_treespec.bench.interleaved_ab import batch1_engine, chat_prompts  # as the A/B

    llm = batch1_engine(method, max_num_seqs=batch)
    turns = pangu240.first_turns(batch * (prompts + 1))  # all of them, if fewer
    texts = chat_prompts(llm.get_tokenizer(), turns)
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                              top_p=top_p or 1.0,  # 1.0: vLLM's default, top-p off
                              seed=seed if temperature > 0 and seeded else None)

    llm.generate([texts[j % len(texts)] for j in range(batch)],
                 [params(j) for j in range(batch)], use_tqdm=False)  # warm-up
    profiler = cProfile.Profile()
    tokens, t0 = 0, time.perf_counter()
    profiler.enable()
    for i in range(1, prompts + 1):  # ``batch`` requests at once, as many clients send them
        group = range(i * batch, (i + 1) * batch)
        outs = llm.generate([texts[j % len(texts)] for j in group], [params(j) for j in group],
                            use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    profiler.disable()
    seconds = time.perf_counter() - t0
    profiler.dump_stats(str(stats_path))
    return {"tokens": tokens, "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 2),
            **summarize(stats_path)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="eagle3:k=3,eagle3_tree",
                   help="as in `vllm-treespec bench`")
    p.add_argument("--prompts", type=int, default=4,
                   help="rounds of --batch prompts (one prompt a round at batch 1)")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts decoded together (max_num_seqs)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests without a seed (as served benchmarks send them)")
    p.add_argument("--out", required=True)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one method
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.batch < 1:
        p.error("--prompts, --batch and --max-tokens must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from vllm_treespec.bench import slug, split_methods

    if args.one is not None:
        row = profile_one(args.one, args.prompts, args.max_tokens,
                          out / f"{slug(args.one)}.pstats", args.temperature, args.top_p,
                          seeded=not args.unseeded, batch=args.batch)
        print("STEP_PROFILE " + json.dumps(row), flush=True)
        return 0
    result = {"prompts": args.prompts, "batch": args.batch, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "top_p": args.top_p,
              "seeded": args.temperature > 0 and not args.unseeded, "methods": {}}
    sampling = ["--temperature", str(args.temperature)] + \
        (["--top-p", str(args.top_p)] if args.top_p is not None else []) + \
        (["--unseeded"] if args.unseeded else [])
    for method in split_methods(args.methods):
        proc = subprocess.run([sys.executable, "-m", "vllm_treespec.bench.step_profile",
                               "--one", method, "--out", str(out),
                               "--prompts", str(args.prompts), "--batch", str(args.batch),
                               "--max-tokens", str(args.max_tokens), *sampling],
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("STEP_PROFILE ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-4000:])
            raise SystemExit(f"step_profile: {method} failed (rc={proc.returncode})")
        result["methods"][method] = json.loads(line.split(" ", 1)[1])
        print(method, result["methods"][method], file=sys.stderr, flush=True)
    (out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
