"""``vllm-treespec train-drafter``: distill an EAGLE-3 drafter for a Llama, Mistral or Qwen target.

Every stage is resumable and keyed to the work directory (default
``~/.cache/vllm-treespec/drafter-work/RUN``); rerunning the same command continues
where it stopped. ``--stages`` runs a subset (default: all). ``--max-minutes``
bounds one invocation: generation stops before a shard it cannot finish, training
at a checkpoint, and the later stages wait for the next invocation (a vocabulary
built from half the data would stay half-built). ``progress.json`` in the work
directory (shards, positions, steps, best held-out proxy, compute spent) is
printed when the command starts and rewritten after every stage.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from vllm_treespec.jsonl import read_jsonl, write_jsonl

STAGES = ("prompts", "generate", "followups", "vocab", "train", "export")
DEFAULT_WORK_ROOT = Path.home() / ".cache" / "vllm-treespec" / "drafter-work"


class Progress:
    """``progress.json``: what a run has done so far, across invocations."""

    def __init__(self, work: Path):
        self.work = work
        self.path = work / "progress.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {
            "generate_seconds": 0.0, "train_seconds": 0.0}

    def update(self, **add_seconds: float) -> None:
        work = self.work
        for key, secs in add_seconds.items():
            self.data[key] = round(self.data.get(key, 0.0) + secs, 1)
        metas = sorted((work / "data").glob("shard_*.jsonl"))
        rows = [r for m in metas for r in read_jsonl(m)]
        self.data.update(shards=len(metas), sequences=len(rows),
                         positions=sum(r["prompt_len"] + r["new_tokens"] - 1 for r in rows))
        last = work / "ckpt" / "last.pt"
        if last.exists():
            import torch

            state = torch.load(last, map_location="cpu", weights_only=False)["state"]
            best = state["best"] or {}
            self.data.update(train_steps=state["step"], total_steps=state["total_steps"],
                             trained_positions=state["positions"],
                             train_seconds=round(state["train_seconds"], 1),
                             best_step=best.get("step"),
                             best_accept_len_proxy=best.get("accept_len_proxy"))
        self.data["compute_hours"] = round(
            (self.data["generate_seconds"] + self.data["train_seconds"]) / 3600, 3)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def _out_of_time(deadline: float | None, stage: str) -> bool:
    if deadline is not None and time.time() >= deadline:
        _log(f"{stage}: the --max-minutes budget is spent; rerun the same command to continue")
        return True
    return False


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-treespec train-drafter",
        description="Distill an EAGLE-3 drafter (one decoder layer over three auxiliary hidden "
        "states of the target) from a Hugging Face target (Llama 2/3, Mistral, Qwen2/2.5, "
        "Qwen3) by "
        "self-distillation, and write a checkpoint that vLLM's `eagle3` method loads.",
    )
    p.add_argument("--target", required=True, help="target model directory (HF format)")
    p.add_argument("--out", required=True, help="output directory for the drafter checkpoint")
    p.add_argument("--work", default=None,
                   help="work directory for data and checkpoints (default: "
                   "~/.cache/vllm-treespec/drafter-work/RUN)")
    p.add_argument("--run", default=None, help="name of the run (default: the name of --out)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget of this invocation; rerun the command to continue")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--num-prompts", type=int, default=16000, help="first-turn prompts to answer")
    g.add_argument("--self-query-frac", type=float, default=0.14,
                   help="share of prompts written by the target itself")
    g.add_argument("--followup-frac", type=float, default=0.1,
                   help="share of answered prompts that get a second turn")
    g.add_argument("--max-tokens", type=int, default=320, help="max new tokens per answer")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--greedy-frac", type=float, default=0.6, help="share of prompts answered greedily")
    g.add_argument("--temperatures", default="0.7,0.85,1.0", help="sampling temperatures for the rest")
    g.add_argument("--gen-batch", type=int, default=128, help="concurrent sequences in vLLM")
    g.add_argument("--shard-size", type=int, default=256, help="prompts per data shard")
    g.add_argument("--aux-layers", default=None,
                   help="target layers whose output feeds the drafter (default: vLLM's choice for "
                   "the target: 2, L/2, L-3)")
    g.add_argument("--threads", default=None, help="VLLM_CPU_OMP_THREADS_BIND for generation (e.g. 0-1)")
    g.add_argument("--backend", choices=("vllm", "transformers"), default="vllm",
                   help="what answers the prompts: vLLM (captures the states while it decodes) "
                   "or transformers (generate, then one capture forward; for a GPU machine "
                   "without vLLM, on --device)")
    v = p.add_argument_group("draft vocabulary")
    v.add_argument("--draft-vocab", type=int, default=16384, help="draft vocabulary size")
    v.add_argument("--no-vocab-corpus", dest="vocab_corpus", action="store_false",
                   help="rank tokens by the generated data only (skip the Python-sources corpus)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs)")
    t.add_argument("--epochs", type=float, default=2.0, help="passes over the data when --steps is unset")
    t.add_argument("--max-hours", type=float, default=None,
                   help="stop training after this many hours of compute (resumable)")
    t.add_argument("--ttt-steps", type=int, default=4, help="unrolled drafting steps (training-time test)")
    t.add_argument("--parallel", type=int, default=None, metavar="K",
                   help="train a parallel-drafting (P-EAGLE) head with K draft slots per forward "
                   "(vLLM: \"parallel_drafting\": true; eagle3_tree: \"draft\": \"parallel\"); "
                   "replaces --ttt-steps")
    t.add_argument("--pard-token", type=int, default=None,
                   help="with --parallel: the token id the slots read (its embedding is fixed, "
                   "the slots' state is learnt; default 0, or the --init head's)")
    t.add_argument("--step-decay", type=float, default=0.8, help="loss weight decay per unrolled step")
    t.add_argument("--hard-weight", type=float, default=0.1, help="weight of the hard top-1 loss term")
    t.add_argument("--tokens-per-batch", type=int, default=4096)
    t.add_argument("--max-seq-len", type=int, default=1024, help="crop longer sequences")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--init", default="target",
                   help="'target': lm_head/norm from the target's head, decoder layer from its last "
                   "layer; 'random': lm_head/norm only; or the directory of an exported head to "
                   "continue training (its draft vocabulary becomes the run's)")
    t.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences for evaluation")
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--save-every", type=int, default=250)
    t.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    t.add_argument("--threads-train", type=int, default=None, help="torch threads for training on CPU")
    t.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weight dtype of the exported checkpoint")
    t.add_argument("--layout", choices=("eagle3", "speculators"), default="eagle3",
                   help="layout of the exported checkpoint: the original EAGLE-3 one "
                   "(LlamaForCausalLMEagle3) or the speculators format (for both, rerun "
                   "the export stage with another --out and the first run's --work or --run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"unknown stage(s): {bad}; choose from {STAGES}", file=sys.stderr)
        return 2
    if args.parallel is not None and args.parallel < 2:
        print(f"--parallel {args.parallel}: K is an integer >= 2 (draft slots per forward)",
              file=sys.stderr)
        return 2
    target = str(Path(args.target).resolve())
    from transformers import AutoConfig

    from .drafter_config import DrafterConfig

    tcfg = AutoConfig.from_pretrained(target)
    why = DrafterConfig.unsupported_target(tcfg)
    if why is not None:  # before any stage runs (they take hours)
        print(f"train-drafter: --target {target}: {why}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    work = (Path(args.work) if args.work else DEFAULT_WORK_ROOT / (args.run or out.name)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes else None
    progress = Progress(work)
    _log(f"work directory {work}; progress so far: {json.dumps(progress.data)}")
    random.seed(args.seed)

    if args.aux_layers:
        aux_layers = tuple(int(x) for x in args.aux_layers.split(","))
    else:
        L = tcfg.num_hidden_layers
        aux_layers = (2, L // 2, L - 3)  # vLLM's default for Llama (SupportsEagle3)
    temps = [float(x) for x in args.temperatures.split(",")]
    (work / "args.json").write_text(json.dumps(vars(args) | {"aux_layers": aux_layers}, indent=2) + "\n")

    answerer = None

    def get_answerer():
        nonlocal answerer
        if answerer is None and args.backend == "transformers":
            from .generate_hf import TransformersAnswerer

            answerer = TransformersAnswerer(target, aux_layers, max_model_len=args.max_model_len,
                                            batch=args.gen_batch, seed=args.seed,
                                            device=args.device)
        elif answerer is None:
            from .generate import VllmAnswerer, make_llm

            answerer = VllmAnswerer(make_llm(target, max_num_seqs=args.gen_batch,
                                             max_model_len=args.max_model_len, seed=args.seed,
                                             threads=args.threads), aux_layers)
        return answerer

    from . import prompts as P

    if "prompts" in stages:
        prompts_path = work / "prompts.jsonl"
        if not prompts_path.exists():
            self_path = work / "self_queries.jsonl"
            n_self = math.ceil(args.num_prompts * args.self_query_frac)
            if n_self and not self_path.exists():
                from .generate import generate_self_queries

                t0 = time.time()
                queries = generate_self_queries(get_answerer(), int(n_self * 1.6), args.seed)
                write_jsonl(self_path, [{"query": q} for q in queries])
                progress.update(generate_seconds=time.time() - t0)
                _log(f"self-queries: {len(queries)} in {time.time() - t0:.0f}s")
            queries = [r["query"] for r in read_jsonl(self_path)] if n_self else []
            mix = dict(P.DEFAULT_MIX)
            mix["self"] = args.self_query_frac
            rows = P.build_prompts(args.num_prompts, args.seed, mix=mix, self_queries=queries)
            write_jsonl(prompts_path, rows)
            (work / "recipe.json").write_text(json.dumps(_recipe(args, P), indent=2) + "\n")
            _log(f"prompts: {len(rows)} -> {prompts_path}")

    data_dir = work / "data"
    if "generate" in stages:
        from .generate import generate_shards

        if _out_of_time(deadline, "generate"):
            return _stopped(progress)

        rows = read_jsonl(work / "prompts.jsonl")
        t0 = time.time()
        stats = generate_shards(
            get_answerer(), rows, data_dir, aux_layers=aux_layers, seed=args.seed,
            max_tokens=args.max_tokens, greedy_frac=args.greedy_frac, temperatures=temps,
            shard_size=args.shard_size, log=_log, deadline=deadline,
            shard_seconds=progress.data.get("generate_seconds", 0.0) / max(1, progress.data.get("shards", 0)),
        )
        progress.update(generate_seconds=stats["seconds"])
        _log(f"generate: {stats} in {time.time() - t0:.0f}s")
        if stats["stopped"]:
            return _stopped(progress)

    if "followups" in stages:
        from .generate import generate_shards

        n_main = math.ceil(len(read_jsonl(work / "prompts.jsonl")) / args.shard_size)
        fpath = work / "followups.jsonl"
        if not fpath.exists():
            rng = random.Random(args.seed + 1)
            rows = []
            for idx in range(n_main):
                meta = data_dir / f"shard_{idx:05d}.jsonl"
                if meta.exists():
                    rows += [r for r in read_jsonl(meta) if r["finish_reason"] == "stop"]
            rng.shuffle(rows)
            chosen = rows[: int(len(rows) * args.followup_frac / max(1e-9, 1.0))]
            chosen = chosen[: math.ceil(args.num_prompts * args.followup_frac)]
            fups = [
                {"id": f"f{i:06d}", "kind": "followup", "messages": P.gen_followup(rng, r["messages"], r["response"])}
                for i, r in enumerate(chosen)
            ]
            write_jsonl(fpath, fups)
            _log(f"followups: {len(fups)} -> {fpath}")
        fups = read_jsonl(fpath)
        if fups:
            stats = generate_shards(
                get_answerer(), fups, data_dir, aux_layers=aux_layers, seed=args.seed,
                max_tokens=args.max_tokens, greedy_frac=args.greedy_frac, temperatures=temps,
                shard_size=args.shard_size, first_shard=n_main, log=_log, deadline=deadline,
                shard_seconds=progress.data["generate_seconds"] / max(1, progress.data.get("shards", 0)),
            )
            progress.update(generate_seconds=stats["seconds"])
            _log(f"followups generate: {stats}")
            if stats["stopped"]:
                return _stopped(progress)

    del answerer  # the generation engine's memory, before training

    if "vocab" in stages:
        from .vocab import build_vocab_from_shards

        vpath = work / "vocab.safetensors"
        if not vpath.exists() and Path(args.init).is_dir():
            from .vocab import copy_vocab_of_head

            _log(f"vocab: {copy_vocab_of_head(args.init, vpath)}")
        elif not vpath.exists():
            t0 = time.time()
            info = build_vocab_from_shards(data_dir, tcfg.vocab_size, args.draft_vocab, vpath,
                                           tokenizer_dir=target, use_corpus=args.vocab_corpus)
            _log(f"vocab: {info} in {time.time() - t0:.0f}s")

    if "train" in stages:
        from .trainer import TrainConfig, train

        cfg = TrainConfig.from_args(args, target=target, aux_layers=aux_layers, deadline=deadline)
        state = train(cfg, work, log=_log)
        progress.update()
        if state["step"] < state["total_steps"] and _out_of_time(deadline, "train"):
            return _stopped(progress)

    if "export" in stages:
        from .export import export_best

        raw = list(sys.argv[1:] if argv is None else argv)
        extra = {
            "command": "vllm-treespec train-drafter " + " ".join(raw),
            "seed": args.seed,
            "data": data_summary(work, args),
        }
        path = export_best(work, out, dtype=args.dtype, log=_log, manifest_extra=extra,
                           layout=args.layout)
        _log(f"export: {path}")
    progress.update()
    return 0


def _stopped(progress: Progress) -> int:
    progress.update()
    _log(f"stopped for time; progress: {json.dumps(progress.data)}")
    return 0


def _recipe(args, P) -> dict:
    from .docstrings import DOC_PACKAGES

    return {
        "prompts": args.num_prompts, "mix": P.DEFAULT_MIX | {"self": args.self_query_frac},
        "followup_frac": args.followup_frac, "max_new_tokens": args.max_tokens,
        "greedy_frac": args.greedy_frac, "temperatures": args.temperatures, "seed": args.seed,
        "python": sys.version.split()[0],
        "sources": "templated instructions/maths/reasoning/extraction, code stubs and tasks from "
                   "docstrings of the Python standard library and " + ", ".join(DOC_PACKAGES)
                   + ", documentation excerpts, queries written by the target, follow-up turns; "
                   "answers generated by the target (" + args.backend + ")",
    }


def data_summary(work: Path, args) -> dict:
    """Recipe and size of the self-distilled corpus, for the drafter's manifest."""
    from collections import Counter

    from . import prompts as P

    kinds, temps = Counter(), Counter()
    seqs = positions = new_tokens = 0
    for meta in sorted((work / "data").glob("shard_*.jsonl")):
        for r in read_jsonl(meta):
            kinds[r["kind"]] += 1
            temps[str(r["temperature"])] += 1
            seqs += 1
            positions += r["prompt_len"] + r["new_tokens"] - 1
            new_tokens += r["new_tokens"]
    recipe_path = work / "recipe.json"
    info = {
        "recipe": json.loads(recipe_path.read_text()) if recipe_path.exists() else _recipe(args, P),
        "sequences": seqs, "positions": positions, "response_tokens": new_tokens,
        "sequences_by_kind": dict(kinds), "sequences_by_temperature": dict(temps),
    }
    vpath = work / "vocab.safetensors"
    if vpath.exists():
        from safetensors import safe_open

        with safe_open(str(vpath), "np") as f:
            info["draft_vocab"] = json.loads(f.metadata().get("info", "{}"))
    return info


if __name__ == "__main__":
    sys.exit(main())
