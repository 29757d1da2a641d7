"""Where a fixed small training budget counts most: data vs steps vs draft
vocabulary, by the held-out acceptance proxy.

One set of self-distilled answers is generated once (``train-drafter --stages
prompts,generate``); every variant then trains from scratch on it (or on its
first half) in its own work directory, with the shards linked, not copied, and
the same held-out answers (the first greedy ones, see ``train.data.split_eval``).
Each variant reports the trainer's held-out proxy (implied chain acceptance
length from teacher-forced top-1 agreement; a target token outside the draft
vocabulary counts as a miss) and the CPU time it took, so the table reads as
proxy per CPU-minute.

    python -m vllm_treespec.bench.drafter_allocation --prompts 600 --steps 150 --out DIR

Each variant warms its learning rate up over a tenth of its steps (the
trainer's default, 200 steps, is sized for full runs: a 60-step variant would
never leave the warm-up, and its proxy would rank nothing).

Resumable: a variant whose ``progress.json`` holds a finished run is not
trained again, and the data stage continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BASE = {"draft_vocab": 8192, "data": 1.0, "steps": 1.0}
VARIANTS = {
    "base": {},
    "vocab 4096": {"draft_vocab": 4096},
    "vocab 16384": {"draft_vocab": 16384},
    "half the data (same steps)": {"data": 0.5},
    "twice the steps": {"steps": 2.0},
}
# Not a variant here: shorter training sequences (--max-seq-len), because the trainer
# crops its held-out sequences the same way, so that proxy would score other data.


def train_drafter(*args: str) -> None:
    cmd = [sys.executable, "-m", "vllm_treespec", "train-drafter", *args]
    print("[allocation]", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def link_data(src: Path, dst: Path, fraction: float) -> None:
    """``dst`` sees ``src``'s prompts and the first ``fraction`` of its shards."""
    (dst / "data").mkdir(parents=True, exist_ok=True)
    link = dst / "prompts.jsonl"
    if not link.exists():
        link.symlink_to(src / "prompts.jsonl")
    shards = sorted((src / "data").glob("shard_*"))
    metas = [s for s in shards if s.suffix == ".jsonl"]
    keep = {m.stem for m in metas[:max(1, round(fraction * len(metas)))]}
    for s in shards:
        target = dst / "data" / s.name
        if s.name.split(".")[0] in keep and not target.exists():
            target.symlink_to(s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps of the base variant")
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of the variants")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "vllm-treespec" / "allocation"))
    ap.add_argument("--out", required=True, help="results directory (allocation.json, .md)")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    from vllm_treespec.assets import ensure_assets

    target = str(ensure_assets().target)
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = work / "data-run"
    t0 = time.time()
    train_drafter("--target", target, "--out", str(work / "unused"), "--work", str(data),
                  "--stages", "prompts,generate", "--num-prompts", str(args.prompts),
                  "--self-query-frac", "0", "--followup-frac", "0",
                  "--max-tokens", str(args.max_tokens), "--gen-batch", str(args.gen_batch),
                  "--shard-size", str(max(1, args.prompts // 8)), "--threads", "0-1")
    data_progress = json.loads((data / "progress.json").read_text())
    rows = []
    for name in variants:
        v = BASE | VARIANTS[name]
        run = work / name.replace(" ", "-").replace(",", "")
        link_data(data, run, v["data"])
        steps = round(args.steps * v["steps"])
        progress = run / "progress.json"
        done = progress.exists() and json.loads(progress.read_text()).get("train_steps") == steps
        if not done:
            train_drafter("--target", target, "--out", str(run / "head"), "--work", str(run),
                          "--stages", "vocab,train", "--draft-vocab", str(v["draft_vocab"]),
                          "--steps", str(steps), "--warmup", str(max(1, steps // 10)),
                          "--eval-every", str(max(1, steps // 3)),
                          "--save-every", str(max(1, steps // 3)),
                          "--tokens-per-batch", str(args.tokens_per_batch),
                          "--threads-train", "2")
        p = json.loads(progress.read_text())
        rows.append({"variant": name, **v, "steps": p.get("train_steps"),
                     "trained_positions": p.get("trained_positions"),
                     "train_minutes": round(p.get("train_seconds", 0.0) / 60, 2),
                     "accept_len_proxy": p.get("best_accept_len_proxy")})
        print("[allocation]", json.dumps(rows[-1]), flush=True)
    result = {"args": vars(args), "data": {k: data_progress.get(k) for k in
                                           ("sequences", "positions", "generate_seconds")},
              "wall_minutes": round((time.time() - t0) / 60, 1), "variants": rows}
    (out / "allocation.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Data: {result['data']['sequences']} answers, {result['data']['positions']} "
             f"positions, generated in {result['data']['generate_seconds']} s.", "",
             "| variant | draft vocab | data | steps | positions trained "
             "| train CPU-min | held-out proxy |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['draft_vocab']} | {r['data']:g} | {r['steps']} | "
              f"{r['trained_positions']} | {r['train_minutes']} | "
              f"{r['accept_len_proxy']:.3f} |" for r in rows]
    (out / "allocation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
