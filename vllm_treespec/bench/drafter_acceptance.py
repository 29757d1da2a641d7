"""Acceptance of an EAGLE-3 drafter under STOCK vLLM ``eagle3`` (chain drafting).

Runs the target with ``speculative_config={"method": "eagle3", "model": DRAFTER,
"num_speculative_tokens": K}``, greedy, on the first turns of the 80 MT-Bench
questions and on HumanEval prompts (chat template applied), and reads vLLM's own
spec-decode counters (``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_accepted_tokens``,
``vllm:spec_decode_num_accepted_tokens_per_pos``) before and after each set:

    mean acceptance length = 1 + accepted / drafts
    acceptance at position i = accepted_at_i / drafts

Defaults measure the embedded SmolLM2 target and its drafter
(``vllm-treespec assets``). Prints a summary and writes JSON (``--out``).

    python -m vllm_treespec.bench.drafter_acceptance --out acceptance.json
    python -m vllm_treespec.bench.drafter_acceptance --target DIR --drafter DIR --num-spec 4

A parallel-drafting head (``pard_token`` in its config.json) runs with
``"parallel_drafting": true``, all its drafts from one forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def mtbench_first_turns(n: int) -> list[str]:
    from vllm_treespec.bench.pangu240 import mtbench_questions

    return [q["turns"][0] for q in mtbench_questions(n)]


def humaneval_prompts(n: int) -> list[str]:
    from vllm_treespec.bench.pangu240 import humaneval_problems

    return [p["prompt"] for p in humaneval_problems(n)]


def _counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            out["per_pos"] = vals if out["per_pos"] is None else [a + b for a, b in zip(out["per_pos"], vals)]
    return out


def _delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"] or [], before["per_pos"] or [0] * len(after["per_pos"] or []))]
    return d


def summarize(c: dict) -> dict:
    drafts = max(1, c["drafts"])
    return {
        "mean_acceptance_length": 1.0 + c["accepted"] / drafts,
        "acceptance_per_position": [a / drafts for a in c["per_pos"]],
        "num_drafts": c["drafts"],
        "num_draft_tokens": c["draft_tokens"],
        "num_accepted_tokens": c["accepted"],
        "num_accepted_tokens_per_pos": c["per_pos"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model dir (default: embedded SmolLM2)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter dir (default: embedded drafter)")
    p.add_argument("--num-spec", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--mtbench", type=int, default=80, help="MT-Bench first turns to use")
    p.add_argument("--humaneval", type=int, default=80, help="HumanEval prompts to use")
    p.add_argument("--batch", type=int, default=16, help="concurrent requests (greedy output does not depend on it)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.target is None or args.drafter is None:
        from vllm_treespec.assets import ensure_assets

        assets = ensure_assets()
        args.target = args.target or str(assets.target)
        args.drafter = args.drafter or str(assets.drafter)

    sets = {"mtbench": mtbench_first_turns(args.mtbench), "humaneval": humaneval_prompts(args.humaneval)}
    # A parallel-drafting head (train-drafter --parallel K) drafts as stock vLLM serves it.
    from vllm_treespec.train.drafter_config import DrafterConfig

    parallel = DrafterConfig.from_hf_dict(
        json.loads((Path(args.drafter) / "config.json").read_text())).parallel
    from vllm import LLM, SamplingParams

    llm = LLM(
        args.target,
        dtype=args.dtype,
        seed=0,
        max_num_seqs=args.batch,
        max_model_len=2048,
        compilation_config={"mode": 0},
        disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": args.drafter,
                            "num_speculative_tokens": args.num_spec,
                            "parallel_drafting": parallel},
    )
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result = {"target": args.target, "drafter": args.drafter, "num_speculative_tokens": args.num_spec,
              "parallel_drafting": parallel, "max_tokens": args.max_tokens, "sets": {}}
    totals = None
    for name, prompts in sets.items():
        if not prompts:
            continue
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True) for q in prompts]
        before = _counters(llm)
        t0 = time.time()
        outs = llm.generate(texts, params, use_tqdm=False)
        dt = time.time() - t0
        after = _counters(llm)
        c = _delta(after, before)
        totals = c if totals is None else {k: (v + c[k] if k != "per_pos" else [a + b for a, b in zip(v, c[k])])
                                           for k, v in totals.items()}
        s = summarize(c)
        s.update(prompts=len(prompts), new_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                 seconds=round(dt, 1))
        result["sets"][name] = s
    result["overall"] = summarize(totals)
    for name, s in list(result["sets"].items()) + [("overall", result["overall"])]:
        per = " ".join(f"{a:.3f}" for a in s["acceptance_per_position"])
        print(f"{name:>10}: mean acceptance length {s['mean_acceptance_length']:.3f} "
              f"(drafts {s['num_drafts']}, accepted {s['num_accepted_tokens']}); per position {per}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["overall"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
