"""Training-time-test distillation of the EAGLE-3 drafter.

Loss, for each unrolled step j = 1..K (weight ``decay**(j-1)``), over rows whose
label lies in a response:

* soft: cross-entropy to the target's next-token distribution restricted to
  the draft vocabulary (from the captured final hidden state and the target's
  tied head) — every position carries the full ranking, not just one token;
* hard: cross-entropy to the target's top-1 within the draft vocabulary
  (``--hard-weight``), which is what greedy verification accepts.

The output layer is evaluated only on rows that carry a label (prompt rows are
still run through the decoder layer: they are keys for later rows).

Evaluation (held-out greedy answers): per-step top-1 agreement with the
target's greedy token (teacher forced), and the chain acceptance it implies,
``1 + mean_t sum_k prod_{i<=k} match_i(t)`` for k = K drafts — on greedy text
that is the acceptance length vLLM would see for chains starting at every
position.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .data import Batch, collate, load_shard, make_batches, shard_files, split_eval
from .drafter_config import DrafterConfig
from .model import Eagle3Drafter
from .target_weights import init_from_target, load_target_head


@dataclasses.dataclass
class TrainConfig:
    target: str
    aux_layers: tuple[int, ...]
    seed: int = 0
    ttt_steps: int = 4
    parallel: bool = False  # train the ttt_steps drafts as parallel-drafting slots (P-EAGLE)
    # The slots' input token (its embedding is the target's, fixed); None: 0 for a new
    # parallel head, the head's own when continuing one.
    pard_token: int | None = None
    step_decay: float = 0.8
    hard_weight: float = 0.1
    tokens_per_batch: int = 4096
    max_seq_len: int = 1024
    lr: float = 1e-3
    warmup: int = 200
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    steps: int | None = None
    epochs: float = 2.0
    max_hours: float | None = None
    deadline: float | None = None  # time.time() at which to stop at a checkpoint
    init: str = "target"  # "target", "random", or an exported head to continue from
    eval_seqs: int = 128
    eval_every: int = 500
    save_every: int = 250
    shards_per_group: int = 4
    device: str | None = None
    threads: int | None = None

    @classmethod
    def from_args(cls, args, target: str, aux_layers, deadline: float | None = None) -> "TrainConfig":
        parallel = getattr(args, "parallel", None)
        return cls(
            target=target, aux_layers=tuple(aux_layers), seed=args.seed,
            ttt_steps=parallel or args.ttt_steps, parallel=bool(parallel),
            pard_token=getattr(args, "pard_token", None),
            step_decay=args.step_decay, hard_weight=args.hard_weight,
            tokens_per_batch=args.tokens_per_batch, max_seq_len=args.max_seq_len, lr=args.lr,
            warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
            steps=args.steps, epochs=args.epochs, max_hours=getattr(args, "max_hours", None),
            deadline=deadline, init=args.init, eval_seqs=args.eval_seqs, eval_every=args.eval_every,
            save_every=args.save_every, device=args.device, threads=args.threads_train,
        )


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def step_losses(model: Eagle3Drafter, head_d: torch.Tensor, batch: Batch, cfg: TrainConfig):
    """Weighted loss and per-step statistics (loss, top-1 agreement, rows) for one batch."""
    states = model.ttt_forward(batch.aux, batch.tokens, cfg.ttt_steps, return_states=True,
                               parallel=cfg.parallel)
    B, L = batch.aux.shape[:2]
    pos = torch.arange(L, device=batch.aux.device)[None]
    # The target's distribution at every label position, computed once and
    # shared by all unrolled steps (step j reads position t + j).
    is_label = (pos <= batch.lengths[:, None] - 1) & (pos >= batch.prompt_lens[:, None])
    row_of = torch.full((B, L + cfg.ttt_steps + 1), -1, dtype=torch.long, device=pos.device)
    lb, lt = is_label.nonzero(as_tuple=True)
    row_of[lb, lt] = torch.arange(len(lb), device=pos.device)
    with torch.no_grad():
        tgt_logits = batch.final[lb, lt] @ head_d.T
        tgt_p = torch.softmax(tgt_logits.float(), dim=-1)
        tgt_top = tgt_logits.argmax(-1)
        del tgt_logits
    total, wsum, stats = 0.0, 0.0, []
    for j, post in enumerate(states, start=1):
        rows = row_of[:, j : j + L]
        b_idx, t_idx = (rows >= 0).nonzero(as_tuple=True)
        if len(b_idx) == 0:
            stats.append((0.0, 0.0, 0))
            continue
        r = rows[b_idx, t_idx]
        logq = torch.log_softmax(model.lm_head(post[b_idx, t_idx]).float(), dim=-1)
        soft = -(tgt_p[r] * logq).sum(-1).mean()
        hard = F.nll_loss(logq, tgt_top[r])
        loss = soft + cfg.hard_weight * hard
        w = cfg.step_decay ** (j - 1)
        total = total + w * loss
        wsum += w
        with torch.no_grad():
            acc = (logq.argmax(-1) == tgt_top[r]).float().mean().item()
        stats.append((float(loss.detach()), acc, len(b_idx)))
    return total / max(wsum, 1e-9), stats


@torch.no_grad()
def evaluate(model: Eagle3Drafter, seqs, cfg: TrainConfig, device) -> dict:
    """Teacher-forced greedy agreement per step and the implied chain acceptance length."""
    model.eval()
    K = cfg.ttt_steps
    hits = np.zeros(K)
    counts = np.zeros(K)
    accept_sum, accept_n = 0.0, 0
    draft_ids = model.draft_ids
    for i in range(0, len(seqs), 8):
        group = seqs[i : i + 8]
        batch = collate(group, K).to(device)
        states = model.ttt_forward(batch.aux, batch.tokens, K, return_states=True,
                                   parallel=cfg.parallel)
        L = batch.aux.shape[1]
        t = torch.arange(L, device=device)[None]
        matches = []
        for j, post in enumerate(states, start=1):
            pred = draft_ids[model.lm_head(post).argmax(-1)]  # target ids [B, L]
            truth = batch.tokens[:, j + 1 : j + 1 + L]  # x_{t+j+1}, the greedy token
            valid = (t + j <= batch.lengths[:, None] - 1) & (t + j >= batch.prompt_lens[:, None])
            m = (pred == truth) & valid
            hits[j - 1] += m.sum().item()
            counts[j - 1] += valid.sum().item()
            matches.append(m)
        full = (t + K <= batch.lengths[:, None] - 1) & (t + 1 >= batch.prompt_lens[:, None])
        run = torch.ones_like(full)
        acc_len = torch.zeros(full.shape, device=device)
        for m in matches:
            run = run & m
            acc_len += run.float()
        accept_sum += acc_len[full].sum().item()
        accept_n += int(full.sum().item())
    model.train()
    per_step = (hits / np.maximum(counts, 1)).tolist()
    return {"top1_per_step": per_step, "accept_len_proxy": 1.0 + accept_sum / max(accept_n, 1),
            "eval_positions": int(counts[0])}


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    prog = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def build_model(cfg: TrainConfig, work: Path, device) -> Eagle3Drafter:
    from transformers import AutoConfig

    from .vocab import load_vocab

    tcfg = AutoConfig.from_pretrained(cfg.target)
    draft_ids = torch.as_tensor(load_vocab(work / "vocab.safetensors"))
    dcfg = DrafterConfig.from_target(tcfg, len(draft_ids), cfg.aux_layers)
    torch.manual_seed(cfg.seed)
    if cfg.init in ("target", "random"):
        model = Eagle3Drafter(dcfg)
        model.set_vocab(draft_ids)
        init_from_target(model, cfg.target, mode=cfg.init)
        return model.to(device)
    _, embed, _, _ = load_target_head(cfg.target)
    model = Eagle3Drafter.load_checkpoint(cfg.init, embed_weight=embed)
    if model.cfg.aux_layers != dcfg.aux_layers or not torch.equal(model.draft_ids, draft_ids.long()):
        raise ValueError(f"--init {cfg.init}: its auxiliary layers {model.cfg.aux_layers} or draft "
                         f"vocabulary differ from this run's ({dcfg.aux_layers}, vocab.safetensors)")
    head, target = model.cfg, dcfg
    if (head.rope_parameters, head.attention_bias) != (target.rope_parameters,
                                                       target.attention_bias):
        raise ValueError(f"--init {cfg.init}: its RoPE {head.rope_parameters} or attention_bias "
                         f"{head.attention_bias} differ from the target's "
                         f"({target.rope_parameters}, {target.attention_bias})")
    return model.to(device)


def _make_parallel(model: Eagle3Drafter, cfg: TrainConfig, eval_seqs, device) -> None:
    """Give the model ``cfg.ttt_steps`` parallel-drafting slots: new ones (their
    stand-in state starts as the mean auxiliary state; a resumed run overwrites it
    from its checkpoint), or a parallel head's own, retrained for this many."""
    vocab = model.cfg.vocab_size
    if cfg.pard_token is not None and not 0 <= cfg.pard_token < vocab:
        raise ValueError(f"--pard-token {cfg.pard_token}: a token id in [0, {vocab - 1}]")
    if model.cfg.parallel:
        if cfg.pard_token not in (None, model.cfg.pard_token):
            raise ValueError(f"--pard-token {cfg.pard_token}: --init {cfg.init} was trained with "
                             f"pard_token {model.cfg.pard_token}; leave it out to continue")
        model.cfg = dataclasses.replace(model.cfg, parallel_slots=cfg.ttt_steps)
        return
    aux = [torch.from_numpy(s.hidden[:, :-1]).float().flatten(1) for s in eval_seqs]
    model.enable_parallel(cfg.pard_token or 0, cfg.ttt_steps, torch.cat(aux).mean(0).to(device))


def train(cfg: TrainConfig, work: Path, log: Callable[[str], None] = print) -> dict:
    from tqdm import tqdm

    device = _device(cfg)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    ckpt_dir = work / "ckpt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    exports = work / "exports"
    exports.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"

    model = build_model(cfg, work, device)
    _, _, head, _ = load_target_head(cfg.target)
    head_d = head[model.draft_ids.cpu()].to(device)

    shards = shard_files(data_dir)
    if not shards:
        raise FileNotFoundError(f"no data shards in {data_dir}")
    first = load_shard(shards[0], cfg.max_seq_len)
    eval_seqs, eval_idx = split_eval(first, cfg.eval_seqs)
    eval_exclude = {(shards[0].name, i) for i in eval_idx}
    del first
    if cfg.parallel:
        _make_parallel(model, cfg, eval_seqs, device)
    elif model.cfg.parallel:
        raise ValueError(f"--init {cfg.init} is a parallel-drafting head; continue it with --parallel")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    state = {"step": 0, "epoch": 0, "group": 0, "batch": 0, "shard_order": None, "total_steps": None,
             "best": None, "history": [], "train_seconds": 0.0, "positions": 0}
    last = ckpt_dir / "last.pt"
    if last.exists():
        ck = torch.load(last, map_location=device, weights_only=False)
        before = {"parallel": False, **ck["config"]}  # checkpoints older than --parallel
        changed = {k: (before[k], getattr(cfg, k)) for k in ("parallel", "ttt_steps")
                   if before[k] != getattr(cfg, k)}
        if changed:
            raise ValueError(f"{last} was trained with other settings {changed} (checkpoint, "
                             f"now); use a new --work directory or the same settings")
        model.load_state_dict(ck["model"], strict=False)
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        random.setstate(ck["py_rng"])
        # map_location moved the CPU generator's ByteTensor too (to CUDA on a GPU).
        torch.set_rng_state(ck["torch_rng"].cpu())
        log(f"[train] resumed at step {state['step']} (epoch {state['epoch']}, group {state['group']}, "
            f"batch {state['batch']})")

    if state["total_steps"] is None:
        if cfg.steps:
            state["total_steps"] = cfg.steps
        else:
            # estimate batches per epoch from the data present now
            n_pos = 0
            for s in shards:
                from safetensors import safe_open

                with safe_open(str(s), "np") as f:
                    off = f.get_tensor("hid_offsets")
                n_pos += int(np.minimum(np.diff(off), cfg.max_seq_len).sum())
            per_epoch = max(1, int(n_pos / (cfg.tokens_per_batch * 0.8)))
            state["total_steps"] = int(per_epoch * cfg.epochs)
    total = state["total_steps"]
    log(f"[train] {sum(p.numel() for p in params) / 1e6:.2f}M trainable params, vocab {model.cfg.draft_vocab_size}, "
        f"{total} steps, {len(eval_seqs)} eval seqs, device {device}")

    def save():
        _atomic_save({"model": {k: v for k, v in model.state_dict().items() if not k.startswith(("embed_tokens", "rotary"))},
                      "opt": opt.state_dict(), "state": state, "py_rng": random.getstate(),
                      "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg)}, last)

    def do_eval():
        res = evaluate(model, eval_seqs, cfg, device)
        res.update(step=state["step"], positions=state["positions"], train_seconds=round(state["train_seconds"]))
        state["history"].append(res)
        out = exports / f"step_{state['step']:06d}"
        model.save_checkpoint(out, dtype=torch.bfloat16)
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        if state["best"] is None or res["accept_len_proxy"] >= state["best"]["accept_len_proxy"]:
            state["best"] = dict(res, path=str(out))
        (work / "train_history.json").write_text(json.dumps(state["history"], indent=2) + "\n")
        log(f"[eval] step {state['step']}: top1/step {[round(x, 3) for x in res['top1_per_step']]}, "
            f"accept_len_proxy {res['accept_len_proxy']:.3f}")
        return res

    if state["step"] == 0 and not state["history"]:
        do_eval()

    secs_at_start = state["train_seconds"]
    bar = tqdm(total=total, initial=state["step"], desc="train", unit="step")
    model.train()
    stop = False
    while state["step"] < total and not stop:
        if state["shard_order"] is None:
            order = [s.name for s in shard_files(data_dir)]
            random.Random(f"{cfg.seed}:order:{state['epoch']}").shuffle(order)
            state["shard_order"] = order
            state["group"], state["batch"] = 0, 0
        order = state["shard_order"]
        groups = [order[i : i + cfg.shards_per_group] for i in range(0, len(order), cfg.shards_per_group)]
        while state["group"] < len(groups) and not stop:
            names = groups[state["group"]]
            seqs = []
            for name in names:
                for i, s in enumerate(load_shard(data_dir / name, cfg.max_seq_len)):
                    if (name, i) not in eval_exclude and s.n > s.prompt_len + 1:
                        seqs.append(s)
            rng = random.Random(f"{cfg.seed}:batches:{state['epoch']}:{state['group']}")
            batches = make_batches(seqs, cfg.tokens_per_batch, rng)
            while state["batch"] < len(batches):
                t0 = time.time()
                batch = collate(batches[state["batch"]], cfg.ttt_steps).to(device)
                lr = _lr_at(state["step"], total, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss, stats = step_losses(model, head_d, batch, cfg)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                state["batch"] += 1
                state["step"] += 1
                state["positions"] += stats[0][2]
                state["train_seconds"] += time.time() - t0
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc="/".join(f"{a:.2f}" for _, a, _ in stats),
                                lr=f"{lr:.1e}", gn=f"{float(gnorm):.2f}")
                if state["step"] % 50 == 0:
                    log(f"[train] step {state['step']}/{total} loss {float(loss.detach()):.4f} "
                        f"acc {[round(a, 3) for _, a, _ in stats]} lr {lr:.2e} gnorm {float(gnorm):.2f} "
                        f"positions {state['positions']} ({state['train_seconds'] / max(1, state['step']):.2f}s/step)")
                if state["step"] % cfg.eval_every == 0 or state["step"] >= total:
                    do_eval()
                if state["step"] % cfg.save_every == 0 or state["step"] >= total:
                    save()
                if state["step"] >= total:
                    stop = True
                    break
                if cfg.max_hours and (state["train_seconds"] - secs_at_start) > cfg.max_hours * 3600:
                    log(f"[train] time budget of {cfg.max_hours} h reached")
                    stop = True
                    break
                if cfg.deadline is not None and time.time() >= cfg.deadline:
                    log(f"[train] --max-minutes reached at step {state['step']}/{total}")
                    stop = True
                    break
            else:
                state["group"] += 1
                state["batch"] = 0
        else:
            state["epoch"] += 1
            state["shard_order"] = None
    bar.close()
    if state["history"] and state["history"][-1]["step"] != state["step"]:
        do_eval()
    save()
    log(f"[train] done: step {state['step']}, {state['positions']} label positions, "
        f"{state['train_seconds'] / 3600:.2f} h, best {state['best']}")
    return state
