"""Check that training-time drafting is what vLLM's ``eagle3`` actually computes.

A drafter trained on a different recurrence than the engine runs scores well
offline and poorly in serving. This module runs stock vLLM with a drafter
checkpoint (greedy, one request at a time), records for every drafting round
the chain's start position, the auxiliary hidden states vLLM handed to the
drafter and the draft tokens it proposed, and then replays each chain with
:meth:`Eagle3Drafter.draft_chain` on the same inputs. Variants that differ from
the engine (post-norm feedback, frozen positions, ``fc`` applied at every
step, the target's RoPE scaling ignored) are replayed too: they must disagree where the engine's recurrence
agrees. A parallel-drafting head (``pard_token`` in its config) runs with
``"parallel_drafting": true`` and is replayed with
:meth:`Eagle3Drafter.draft_parallel`; the sequential recurrence is its wrong
variant.

Command line::

    python -m vllm_treespec.train.verify --target DIR --drafter DIR [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

VARIANTS = {
    "engine": {},
    "postnorm_feedback": {"feed_hidden": "postnorm"},
    "frozen_positions": {"advance_positions": False},
    "fc_every_step": {"fc_every_step": True},
}
PARALLEL_VARIANTS = {"engine": "draft_parallel", "sequential_chain": "draft_chain"}

DEFAULT_PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a Python function that returns the squares of the even numbers in a list.",
    "Give me three tips for writing a good cover letter.",
    "What is the difference between weather and climate?",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a haiku about autumn leaves.",
]


def capture_vllm_drafts(target: str, drafter: str, prompts: list[str], num_spec: int = 4,
                        max_tokens: int = 96, parallel: bool = False) -> list[dict]:
    """Run stock vLLM ``eagle3`` greedily and record each drafting round."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from .generate import _model_runner

    llm = LLM(
        target, dtype="float32", max_model_len=1024, max_num_seqs=1, seed=0,
        compilation_config={"mode": 0}, enable_prefix_caching=False,
        speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": num_spec,
                            "parallel_drafting": parallel},
    )
    runner = _model_runner(llm)
    proposer = runner.drafter
    rounds: list[dict] = []
    states: dict[int, torch.Tensor] = {}
    orig = proposer.propose

    def propose(*args, **kw):
        names = ["num_speculative_tokens", "target_token_ids", "target_positions",
                 "target_hidden_states", "next_token_ids", "token_indices_to_sample"]
        bound = dict(zip(names, args)) | kw
        pos = bound["target_positions"].cpu()
        hs = bound["target_hidden_states"]
        hs = torch.cat(hs, dim=-1) if isinstance(hs, (list, tuple)) else hs
        hs = hs[: len(pos)].detach().float().cpu().clone()
        for p, h in zip(pos.tolist(), hs):
            states[p] = h
        idx = bound.get("token_indices_to_sample")
        start = int(pos[int(idx[0])]) if idx is not None else int(pos[-1])
        drafts = orig(*args, **kw)
        rounds.append({"start": start, "next": int(bound["next_token_ids"][0]),
                       "drafts": drafts[0].tolist()})
        return drafts

    proposer.propose = propose
    tok = llm.get_tokenizer()
    out = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        rounds.clear(), states.clear()
        res = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
        seq = list(res.prompt_token_ids) + list(res.outputs[0].token_ids)
        n = max(states) + 1
        aux = torch.stack([states[i] for i in range(n)])
        out.append({"tokens": seq, "aux": aux, "rounds": list(rounds),
                    "output_ids": list(res.outputs[0].token_ids)})
    del llm
    return out


def plain_greedy(target: str, prompts: list[str], max_tokens: int = 96) -> list[list[int]]:
    """Greedy outputs of the target without speculation (same engine settings)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    llm = LLM(target, dtype="float32", max_model_len=1024, max_num_seqs=1, seed=0,
              compilation_config={"mode": 0}, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    outs = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        res = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
        outs.append(list(res.outputs[0].token_ids))
    del llm
    return outs


def compare(model, captures: list[dict], num_spec: int) -> dict:
    """Per-variant share of vLLM's draft tokens reproduced, per step."""
    result = {}
    if model.cfg.parallel:
        variants = {name: (getattr(model, method), {}) for name, method in PARALLEL_VARIANTS.items()}
    else:
        variants = {name: (model.draft_chain, kw) for name, kw in VARIANTS.items()}
        if model.cfg.rope_parameters["rope_type"] != "default":  # the target's scaling ignored
            variants["unscaled_rope"] = (_unscaled_rope(model).draft_chain, {})
    for name, (draft, kw) in variants.items():
        hits = [0] * num_spec
        total = [0] * num_spec
        for cap in captures:
            toks = torch.tensor(cap["tokens"])
            for r in cap["rounds"]:
                t = r["start"]
                if t + 1 >= len(toks) or t >= len(cap["aux"]) or int(toks[t + 1]) != r["next"]:
                    continue
                mine = draft(cap["aux"], toks, t, num_spec, **kw)
                for j, (a, b) in enumerate(zip(mine, r["drafts"])):
                    hits[j] += int(a == b)
                    total[j] += 1
        result[name] = {
            "match_per_step": [h / max(1, n) for h, n in zip(hits, total)],
            "rounds": total[0],
        }
    return result


def _unscaled_rope(model):
    """``model`` with its RoPE scaling dropped (the target's theta kept)."""
    import dataclasses

    cfg = dataclasses.replace(model.cfg, rope_parameters=None)
    wrong = type(model)(cfg, embed_weight=model.embed_tokens.weight.data)
    wrong.load_state_dict(model.state_dict())
    return wrong.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="the head, in the original layout")
    p.add_argument("--served-drafter", default=None,
                   help="the directory vLLM loads (default: --drafter), e.g. the same head "
                   "in the speculators layout")
    p.add_argument("--num-spec", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS))
    p.add_argument("--check-greedy", action="store_true",
                   help="also run the target without speculation and compare greedy outputs")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    from .model import Eagle3Drafter
    from .target_weights import load_target_head

    prompts = DEFAULT_PROMPTS[: args.prompts]
    _, embed, _, _ = load_target_head(args.target)
    model = Eagle3Drafter.load_checkpoint(args.drafter, embed_weight=embed).eval()
    captures = capture_vllm_drafts(args.target, args.served_drafter or args.drafter, prompts,
                                   args.num_spec, args.max_tokens, parallel=model.cfg.parallel)
    res = {"variants": compare(model, captures, args.num_spec)}
    drafts = sum(len(c["rounds"]) for c in captures)
    accepted = sum(len(c["output_ids"]) for c in captures) - drafts  # each round emits accepted + 1
    res["acceptance_length"] = 1.0 + accepted / max(1, drafts)
    if args.check_greedy:
        plain = plain_greedy(args.target, prompts, args.max_tokens)
        res["greedy_identical"] = [c["output_ids"] == p for c, p in zip(captures, plain)]
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
