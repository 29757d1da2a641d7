"""Batch-1 decode cost of several methods, measured interleaved in one process.

Why: on a shared machine, back-to-back server runs (``vllm-treespec bench``)
drift between methods by more than the few-percent differences of an adaptive
budget that mostly stays off (docs/benchmarks.md). Here every method's engine
lives in the same process and each prompt is sent to all of them in turn, so slow
drift hits every method alike. Per step it also splits the worker's time
into the forward (``execute_model``) and sampling + drafting (``sample_tokens``),
for one-token (plain or "off") steps and for verify steps separately.

    python -m vllm_treespec.bench.interleaved_ab --methods none,eagle3_tree --prompts 6 \
        --max-tokens 256

``--chat`` formats each prompt with the model's chat template, as a served chat
request is; the format matters (RESULTS.md: the tree's lead in acceptance over a
chain shrinks on chat-formatted prompts).

Engines are separate processes, and each one's forward speed can differ
systematically (seen: 10-25 % between two engines with the same target); the
split shows that apart from what speculation adds. ``tree_totals`` are the tree
engine's own counters since it started (its warm-up request included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def _install(worker) -> bool:
    """collective_rpc target: time every execute_model / sample_tokens pair."""
    runner = worker.model_runner
    record = runner._ab_steps = []
    execute, sample = runner.execute_model, runner.sample_tokens
    current = {}

    def execute_model(scheduler_output, *args, **kwargs):
        t = time.perf_counter()
        out = execute(scheduler_output, *args, **kwargs)
        current.update(n=scheduler_output.total_num_scheduled_tokens,
                       verify=bool(scheduler_output.scheduled_spec_decode_tokens),
                       forward=time.perf_counter() - t)
        return out

    def sample_tokens(*args, **kwargs):
        t = time.perf_counter()
        out = sample(*args, **kwargs)
        record.append((current.get("n", 0), current.get("verify", False),
                       current.get("forward", 0.0), time.perf_counter() - t))
        return out

    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    return True


def _collect(worker):
    runner = worker.model_runner
    steps, runner._ab_steps[:] = list(runner._ab_steps), []
    metrics = getattr(runner, "tree_metrics", None)
    return steps, (dataclasses.asdict(metrics.total) if metrics is not None else None)


def _split(steps) -> dict:
    """One-token steps (plain, or "off") and verify steps (some request has
    drafts); prefill steps are neither."""
    def mean_ms(rows, i):
        return round(1e3 * statistics.mean(r[i] for r in rows), 2) if rows else None
    one = [s for s in steps if s[0] == 1 and not s[1]]
    verify = [s for s in steps if s[1]]
    return {"one_token_steps": len(one), "one_token_forward_ms": mean_ms(one, 2),
            "one_token_sample_ms": mean_ms(one, 3), "verify_steps": len(verify),
            "verify_forward_ms": mean_ms(verify, 2), "verify_sample_ms": mean_ms(verify, 3)}


def batch1_engine(method: str, max_num_seqs: int = 1):
    """One batch-1 engine for ``method`` (as in `vllm-treespec bench`): the shipped
    target in fp32, its drafter, no prefix caching (every prompt is prefilled);
    ``max_num_seqs`` for a larger batch."""
    from vllm import LLM

    from vllm_treespec.assets import ensure_assets
    from vllm_treespec.bench import parse_method

    assets = ensure_assets()
    defaults = argparse.Namespace(drafter=str(assets.drafter), eagle3_k=3, tree=None)
    return LLM(model=str(assets.target), dtype="float32", max_model_len=4096, seed=0,
               enable_prefix_caching=False, speculative_config=parse_method(method, defaults)[1],
               max_num_seqs=max_num_seqs)


def chat_prompts(tokenizer, turns) -> list[str]:
    """pangu240 turns in the model's chat template, as a served chat request is."""
    return [tokenizer.apply_chat_template(t.messages, add_generation_prompt=True,
                                          tokenize=False) for t in turns]


def greedy_first_turns_tok_s(llm, prompts: int, max_tokens: int) -> float:
    """Greedy decode the first ``prompts`` pangu240 first turns (chat-formatted) in
    one ``generate`` call; output tokens per second of wall time."""
    from vllm import SamplingParams

    from vllm_treespec.bench import pangu240

    texts = chat_prompts(llm.get_tokenizer(), pangu240.first_turns(prompts))
    t0 = time.perf_counter()
    outputs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="none,eagle3_tree",
                   help="as in `vllm-treespec bench`: none, eagle3:k=N, "
                        "eagle3_tree:num_nodes=8,depth=3,adaptive=false")
    p.add_argument("--prompts", type=int, default=6, help="first N pangu240 first turns")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--chat", action="store_true",
                   help="format prompts with the model's chat template, as a served "
                        "chat request is (default: the raw prompt text)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of local functions
    from vllm_treespec.cpu_openmp import preload_intel_openmp

    preload_intel_openmp()  # every engine alike, as `vllm-treespec serve` does
    from vllm import SamplingParams

    from vllm_treespec.bench import pangu240, split_methods

    methods = split_methods(args.methods)
    engines = {m: batch1_engine(m) for m in methods}
    turns = pangu240.first_turns(args.prompts)
    if args.chat:
        prompts = chat_prompts(next(iter(engines.values())).get_tokenizer(), turns)
    else:
        prompts = [t.messages[-1]["content"] for t in turns]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up, then start recording
        llm.generate(prompts[:1], greedy, use_tqdm=False)
        llm.collective_rpc(_install)
    wall = dict.fromkeys(methods, 0.0)
    for prompt in prompts:
        for method, llm in engines.items():
            t = time.perf_counter()
            llm.generate([prompt], greedy, use_tqdm=False)
            wall[method] += time.perf_counter() - t
    tokens = len(prompts) * args.max_tokens
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "chat": args.chat,
              "methods": {}}
    for method, llm in engines.items():
        steps, totals = llm.collective_rpc(_collect)[0]
        result["methods"][method] = {
            "tok_s": round(tokens / wall[method], 2),
            "vs_first": round(wall[methods[0]] / wall[method], 3),
            **_split(steps), "tree_totals": totals}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
