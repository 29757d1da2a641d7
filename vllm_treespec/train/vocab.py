"""Draft vocabulary: the target tokens the drafter can propose.

The drafter's output layer covers only ``draft_vocab`` ids; vLLM maps draft id
``i`` to target id ``i + d2t[i]``. A token outside the set can never be
drafted, so the set is chosen by how often the *target writes* each token:
counts over every response token of the self-distilled corpus (millions of
tokens), plus smaller weights for prompt tokens and for a text corpus of
Python sources and documentation found on the machine, which ranks tokens the
responses happen not to contain. Special tokens the target ends turns with
are always kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PROMPT_WEIGHT = 0.05
CORPUS_WEIGHT = 0.05


def count_shard(path: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(response token counts, prompt token counts) of one shard."""
    from safetensors.numpy import load_file

    d = load_file(str(path))
    resp = np.zeros(vocab_size, np.int64)
    prm = np.zeros(vocab_size, np.int64)
    toks, off, plens = d["tokens"], d["tok_offsets"], d["prompt_lens"]
    for i in range(len(plens)):
        a, b = int(off[i]), int(off[i + 1])
        p = int(plens[i])
        resp += np.bincount(toks[a + p : b], minlength=vocab_size)
        prm += np.bincount(toks[a : a + p], minlength=vocab_size)
    return resp, prm


def corpus_counts(tokenizer, vocab_size: int, max_chars: int = 40_000_000) -> np.ndarray:
    """Token counts over Python's standard library sources and docs on this machine."""
    import sysconfig

    counts = np.zeros(vocab_size, np.int64)
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            t = f.read_text(errors="ignore")
        except OSError:
            continue
        texts.append(t)
        total += len(t)
        if total >= max_chars:
            break
    try:
        from pydoc_data.topics import topics

        texts.extend(topics.values())
    except ImportError:
        pass
    for i in range(0, len(texts), 256):
        enc = tokenizer(texts[i : i + 256], add_special_tokens=False)["input_ids"]
        for ids in enc:
            counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def select_vocab(resp: np.ndarray, prompt: np.ndarray, corpus: np.ndarray | None, size: int,
                 always: list[int] = ()) -> np.ndarray:
    """Top-``size`` target ids by weighted normalised frequency, sorted ascending."""
    def norm(c):
        c = c.astype(np.float64)
        return c / max(1.0, c.sum())

    score = norm(resp) + PROMPT_WEIGHT * norm(prompt)
    if corpus is not None:
        score = score + CORPUS_WEIGHT * norm(corpus)
    # deterministic tie-break: lower id first
    order = np.lexsort((np.arange(len(score)), -score))
    chosen = list(dict.fromkeys([int(a) for a in always if 0 <= a < len(score)] + order.tolist()))[:size]
    return np.sort(np.asarray(chosen, np.int64))


def mapping(draft_ids: np.ndarray | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as vLLM reads them: target = draft + d2t[draft]; t2d[target] = in draft vocab."""
    ids = torch.as_tensor(np.asarray(draft_ids), dtype=torch.long)
    if len(ids) and (ids[1:] <= ids[:-1]).any():
        raise ValueError("draft ids must be strictly increasing")
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, draft_ids: np.ndarray) -> float:
    return float(counts[draft_ids].sum() / max(1, counts.sum()))


def build_vocab_from_shards(data_dir: Path, vocab_size: int, size: int, out_path: Path,
                            tokenizer_dir: str | None = None, always: list[int] = (),
                            use_corpus: bool = True) -> dict:
    from safetensors.numpy import save_file
    from tqdm import tqdm

    shards = sorted(Path(data_dir).glob("shard_*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no shards in {data_dir}")
    per = [count_shard(s, vocab_size) for s in tqdm(shards, desc="vocab counts")]
    resp = sum(r for r, _ in per)
    prm = sum(p for _, p in per)
    corpus = None
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        if use_corpus:
            corpus = corpus_counts(tok, vocab_size)
        always = list(always) + [int(i) for i in tok.all_special_ids]
    info = {"shards": len(shards), "response_tokens": int(resp.sum()), "prompt_tokens": int(prm.sum()),
            "corpus_tokens": int(corpus.sum()) if corpus is not None else 0, "size": size}
    # held-out estimate: choose from all but the last tenth of the shards
    k = max(1, len(shards) // 10)
    if len(shards) > 1:
        r_fit = sum(r for r, _ in per[:-k])
        p_fit = sum(p for _, p in per[:-k])
        r_held = sum(r for r, _ in per[-k:])
        ids_fit = select_vocab(r_fit, p_fit, corpus, size, always)
        info["heldout_response_coverage"] = coverage(r_held, ids_fit)
    ids = select_vocab(resp, prm, corpus, size, always)
    info["response_coverage"] = coverage(resp, ids)
    info["distinct_response_tokens"] = int((resp > 0).sum())
    save_file({"draft_ids": ids, "response_counts": resp, "prompt_counts": prm,
               **({"corpus_counts": corpus} if corpus is not None else {})}, str(out_path),
              metadata={"info": json.dumps(info)})
    return info


def copy_vocab_of_head(head_dir: str | Path, out_path: Path) -> dict:
    """The draft vocabulary of an exported head, as this stage's file (for
    training that continues from the head)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(Path(head_dir) / "model.safetensors"), "np") as f:  # weights are bf16
        d2t = f.get_tensor("d2t").astype(np.int64)
    ids = np.arange(len(d2t), dtype=np.int64) + d2t
    info = {"size": len(ids), "from_head": str(head_dir)}
    save_file({"draft_ids": ids}, str(out_path), metadata={"info": json.dumps(info)})
    return info


def load_vocab(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(path))["draft_ids"]
