"""Heads trained by ``train-drafter`` on architecture twins, served by stock ``eagle3``
and by ``eagle3_tree``, against a random head.

A twin with random weights is chaotic: which token follows depends on the whole
context in a way no one-layer head can learn (a head trained on one rehearses its
training answers and guesses held-out ones at chance). So each twin
(``tests/integration/twins.py``: Llama 3.2's or Qwen3's config, shrunk) is first
taught to be a small language model: ``--pretrain-steps`` of next-token training on
Python sources of the standard library. Then, per twin:

1. ``vllm-treespec train-drafter`` on the twin (its own prompts, answers and
   vocabulary; export in the original layout, then again with
   ``--layout speculators``);
2. a random head of the same shape (the tests' ``random_eagle3_drafter``);
3. greedy, on held-out prompts (HumanEval and MT-Bench first turns, never in the
   training prompts): plain vLLM, stock ``eagle3`` k = 3 with each head in each
   layout, and ``eagle3_tree`` (default tree, fixed budget: on a twin the head
   costs about as much as the target, so the adaptive budget turns speculation
   off) with each. Mean acceptance length is vLLM's own counters
   (1 + accepted / drafts); every speculative output is compared with plain's.
4. the same engines at T = 0.8, one seed per request: a twin this small answers
   greedily in loops of a token or two, which any head predicts; sampled text
   is varied, and acceptance there is what the head learnt.

    python -m vllm_treespec.bench.twin_heads \
        --out benchmarks/results/twin-heads-vllmREL-MACHINE-COMMIT --work /tmp/twin-heads

``--work`` holds the twins, heads, training runs and per-engine results (rerun the
command to resume); ``--out`` gets ``twin_heads.json`` and the training logs.

Each engine runs in its own process (``measure``), one after another.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# The twins and the random head are the test suite's (tests/integration/twins.py and
# drafters.py), so this benchmark runs from a checkout of the repository.
ROOT = Path(__file__).resolve().parents[2]

TREE = {"method": "eagle3_tree", "adaptive": False}
CHAIN = {"method": "eagle3", "num_speculative_tokens": 3}
# Sampled answers (seeded): a small LM's greedy text loops on a token or two.
SAMPLED = 0.8


def pretrain(twin: Path, steps: int, seq_len: int = 128, batch: int = 8, log=print) -> dict:
    """Next-token training of the twin in place on stdlib Python sources."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(twin)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids: list[int] = []
    for f in files:
        ids += tok(f.read_text(errors="ignore"))["input_ids"]
        if len(ids) > steps * batch * seq_len:
            break
    data = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    t0, losses = time.time(), []
    for step in range(steps):
        rows = data[torch.randint(len(data), (batch,))]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(float(loss))
        if step % 50 == 0 or step == steps - 1:
            log(f"[pretrain] {twin.name} step {step}: loss {losses[-1]:.2f}")
    config = (twin / "config.json").read_text()
    model.save_pretrained(twin, safe_serialization=True)
    (twin / "config.json").write_text(config)  # the published form, as build_twin keeps it
    return {"steps": steps, "tokens_per_step": batch * seq_len, "corpus_tokens": int(data.numel()),
            "first_loss": round(losses[0], 3), "last_loss": round(sum(losses[-20:]) / 20, 3),
            "seconds": round(time.time() - t0, 1)}


def held_out_prompts(n: int) -> list[str]:
    from vllm_treespec.bench.pangu240 import humaneval_problems, mtbench_questions

    return ([p["prompt"] for p in humaneval_problems(n // 2)]
            + [q["turns"][0] for q in mtbench_questions(n - n // 2)])


def measure(target: str, spec: dict | None, prompts: list[str], max_tokens: int,
            temperature: float = 0.0) -> dict:
    """One engine: its outputs (greedy, or sampled with a seed per request) and vLLM's
    spec-decode counters."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm_treespec  # noqa: F401  (the plugin, for eagle3_tree)
    from vllm import LLM, SamplingParams

    llm = LLM(target, dtype="float32", seed=0, max_num_seqs=8, max_model_len=2048,
              compilation_config={"mode": 0}, disable_log_stats=False,
              speculative_config=spec)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in prompts]
    t0 = time.time()
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i)
              for i in range(len(texts))]
    outs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.time() - t0
    counters = {"drafts": 0, "accepted": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            counters["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            counters["accepted"] += m.value
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(seconds, 1),
            "method": _served_method(llm.llm_engine.vllm_config) if spec else None,
            **counters,
            "mean_acceptance_length": round(1 + counters["accepted"] / max(1, counters["drafts"]), 3)}


def _served_method(config) -> str:
    """What the engine serves: trees (our additional config present) or the method."""
    if (config.additional_config or {}).get("eagle3_tree") is not None:
        return "eagle3_tree"
    return config.speculative_config.method


def run_measure(work: Path, label: str, target: Path, spec: dict | None, prompts, max_tokens,
                temperature: float = 0.0):
    path = work / (f"{label}.json" if temperature == 0 else f"{label}-t{temperature}.json")
    if not path.exists():
        args = json.dumps({"target": str(target), "spec": spec, "prompts": prompts,
                           "max_tokens": max_tokens, "temperature": temperature})
        subprocess.run([sys.executable, "-m", "vllm_treespec.bench.twin_heads", "measure", args,
                        str(path)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def train_head(twin: Path, work: Path, args) -> dict[str, Path]:
    heads = {"eagle3": work / "head-eagle3", "speculators": work / "head-speculators"}
    common = [sys.executable, "-m", "vllm_treespec", "train-drafter", "--target", str(twin),
              "--work", str(work / "train"), "--seed", "0", "--num-prompts",
              str(args.train_prompts), "--self-query-frac", "0", "--followup-frac", "0",
              "--max-tokens", "128", "--gen-batch", "16", "--shard-size", "64",
              "--draft-vocab", "4096", "--no-vocab-corpus", "--aux-layers", "1,2,3",
              "--steps", str(args.train_steps), "--eval-every", "100", "--save-every", "100",
              "--eval-seqs", "8", "--tokens-per-batch", "4096", "--lr", "2e-3",
              "--warmup", "30", "--threads-train", "2", "--dtype", "float32"]
    with open(work / "train-drafter.log", "a") as log:
        for layout, out in heads.items():
            if not (out / "config.json").exists():
                stages = [] if layout == "eagle3" else ["--stages", "export"]
                subprocess.run(common + ["--out", str(out), "--layout", layout] + stages,
                               check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return heads


def _test_fixtures():
    """``tests.integration.twins`` and ``tests.integration.drafters`` of the checkout."""
    if not (ROOT / "tests" / "integration" / "twins.py").is_file():
        raise SystemExit("twin_heads builds its twins with the test suite (tests/integration/): "
                         "run it from a checkout of the repository")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return (importlib.import_module("tests.integration.twins"),
            importlib.import_module("tests.integration.drafters"))


def one_twin(name: str, args, work_root: Path) -> dict:
    from vllm_treespec.assets import ensure_target

    twins, drafters = _test_fixtures()
    AUX_LAYERS, build_twin = twins.AUX_LAYERS, twins.build_twin
    random_eagle3_drafter = drafters.random_eagle3_drafter

    work = work_root / name
    twin = work / "target"
    result: dict = {"twin": name}
    if not (work / "pretrain.json").exists():
        build_twin(name, twin, ensure_target())
        (work / "pretrain.json").write_text(json.dumps(pretrain(twin, args.pretrain_steps)))
    result["pretrain"] = json.loads((work / "pretrain.json").read_text())
    heads = dict(train_head(twin, work, args))
    heads["random"] = work / "head-random"
    if not (heads["random"] / "config.json").exists():
        random_eagle3_drafter(twin, heads["random"], aux_layers=AUX_LAYERS)
    prompts = held_out_prompts(args.prompts)
    plain = run_measure(work, "plain", twin, None, prompts, args.max_tokens)
    result["engines"] = {}
    for head_name, head in heads.items():
        for method, spec in (("eagle3", CHAIN), ("eagle3_tree", TREE)):
            spec = dict(spec, model=str(head))
            r = run_measure(work, f"{method}-{head_name}", twin, spec, prompts, args.max_tokens)
            sampled = run_measure(work, f"{method}-{head_name}", twin, spec, prompts,
                                  args.max_tokens, SAMPLED)
            result["engines"][f"{method} {head_name}"] = {
                "served_as": r["method"], "mean_acceptance_length": r["mean_acceptance_length"],
                "drafts": r["drafts"], "accepted": r["accepted"], "seconds": r["seconds"],
                "greedy_identical": sum(a == b for a, b in zip(r["outputs"], plain["outputs"])),
                "prompts": len(prompts),
                f"mean_acceptance_length_t{SAMPLED}": sampled["mean_acceptance_length"],
                f"distinct_tokens_t{SAMPLED}": len({t for o in sampled["outputs"] for t in o})}
    result["plain_seconds"] = plain["seconds"]
    # A small LM's greedy text loops; how varied it is says what acceptance means here.
    result["plain_distinct_tokens_per_answer"] = [len(set(o)) for o in plain["outputs"]]
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "measure":
        a = json.loads(argv[1])
        Path(argv[2]).write_text(json.dumps(measure(a["target"], a["spec"], a["prompts"],
                                                    a["max_tokens"], a.get("temperature", 0.0))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--twins", default="llama3,qwen3")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--train-prompts", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [one_twin(name, args, Path(args.work)) for name in args.twins.split(",")]
    for name in args.twins.split(","):
        shutil.copy(Path(args.work) / name / "train-drafter.log", out / f"{name}-train-drafter.log")
    (out / "twin_heads.json").write_text(json.dumps({"args": vars(args), "twins": results},
                                                    indent=2) + "\n")
    for r in results:
        print(f"{r['twin']}: pretrain loss {r['pretrain']['first_loss']} -> "
              f"{r['pretrain']['last_loss']}")
        for k, v in r["engines"].items():
            print(f"  {k:28s} served as {v['served_as']:12s} acceptance "
                  f"{v['mean_acceptance_length']:.2f} (T = {SAMPLED}: "
                  f"{v[f'mean_acceptance_length_t{SAMPLED}']:.2f})  greedy identical "
                  f"{v['greedy_identical']}/{v['prompts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
