"""Reading the self-distilled shards and batching them for training."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch

from vllm_treespec.jsonl import read_jsonl


@dataclasses.dataclass
class Sequence:
    tokens: np.ndarray  # int32 [n + 1]
    hidden: np.ndarray  # fp16 [n, A + 1, d]
    prompt_len: int
    greedy: bool
    kind: str

    @property
    def n(self) -> int:
        return len(self.hidden)


def shard_files(data_dir: Path) -> list[Path]:
    """Completed shards (both the tensors and their metadata present)."""
    out = []
    for st in sorted(Path(data_dir).glob("shard_*.safetensors")):
        if st.with_suffix(".jsonl").exists():
            out.append(st)
    return out


def load_shard(path: Path, max_len: int | None = None) -> list[Sequence]:
    from safetensors.numpy import load_file

    d = load_file(str(path))
    meta = read_jsonl(path.with_suffix(".jsonl"))
    toks, hid = d["tokens"], d["hidden"]
    to, ho, pl = d["tok_offsets"], d["hid_offsets"], d["prompt_lens"]
    seqs = []
    for i, m in enumerate(meta):
        t = toks[to[i] : to[i + 1]]
        h = hid[ho[i] : ho[i + 1]]
        if max_len is not None and len(h) > max_len:
            # keep the start: the drafter attends to every earlier position
            h, t = h[:max_len], t[: max_len + 1]
        seqs.append(Sequence(t, h, int(pl[i]), m.get("temperature", 0.0) == 0.0, m.get("kind", "")))
    return seqs


def split_eval(seqs: list[Sequence], n_eval: int) -> tuple[list[Sequence], list[int]]:
    """First ``n_eval`` greedy sequences (the held-out set) and their indices."""
    idx = [i for i, s in enumerate(seqs) if s.greedy and s.n > s.prompt_len + 8][:n_eval]
    return [seqs[i] for i in idx], idx


def make_batches(seqs: list[Sequence], tokens_per_batch: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-bucketed batches of at most ``tokens_per_batch`` padded positions."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    batches = []
    bucket = 64
    for i in range(0, len(order), bucket):
        chunk = sorted(order[i : i + bucket], key=lambda j: seqs[j].n)
        cur: list[int] = []
        for j in chunk:
            longest = max([seqs[k].n for k in cur] + [seqs[j].n])
            if cur and longest * (len(cur) + 1) > tokens_per_batch:
                batches.append([seqs[k] for k in cur])
                cur = []
            cur.append(j)
        if cur:
            batches.append([seqs[k] for k in cur])
    rng.shuffle(batches)
    return batches


@dataclasses.dataclass
class Batch:
    aux: torch.Tensor  # [B, L, A*d] float32
    final: torch.Tensor  # [B, L, d] float32 (target's post-norm state)
    tokens: torch.Tensor  # [B, L + K + 1] long
    lengths: torch.Tensor  # [B] fed positions n
    prompt_lens: torch.Tensor  # [B]

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate(seqs: list[Sequence], num_steps: int) -> Batch:
    B = len(seqs)
    L = max(s.n for s in seqs)
    A1, d = seqs[0].hidden.shape[1:]
    hid = np.zeros((B, L, A1, d), np.float16)
    toks = np.zeros((B, L + num_steps + 1), np.int64)
    for i, s in enumerate(seqs):
        hid[i, : s.n] = s.hidden
        toks[i, : len(s.tokens)] = s.tokens
    h = torch.from_numpy(hid).float()
    return Batch(
        aux=h[:, :, : A1 - 1].reshape(B, L, (A1 - 1) * d),
        final=h[:, :, A1 - 1],
        tokens=torch.from_numpy(toks),
        lengths=torch.tensor([s.n for s in seqs]),
        prompt_lens=torch.tensor([s.prompt_len for s in seqs]),
    )
