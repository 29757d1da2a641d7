"""Self-distillation data: the target answers the prompts through vLLM, and the
hidden states the drafter trains on are captured during that same generation.

The drafter reads, at every position, the target's auxiliary hidden states
(residual stream after the layers named by ``eagle_aux_hidden_state_layer_ids``)
and is supervised by the target's next-token distribution, i.e. the final
(post-norm) hidden state times the tied embedding. Both are produced anyway
while vLLM decodes, so the engine is run in-process and its model runner's
forward is wrapped to copy them out per request. This costs one pass instead
of a generation pass plus a separate capture pass, and the hidden states are
exactly those vLLM computes when it later runs the drafter.

Output: ``shard_NNNNN.safetensors`` + ``shard_NNNNN.jsonl`` per block of
prompts. A shard holds, for S sequences with n_i fed tokens each:

* ``tokens``  int32  [sum(n_i + 1)]  – prompt + response (every token, incl. the last);
* ``hidden``  fp16   [sum(n_i), A + 1, d] – A aux states and the final hidden state
  at each fed position;
* ``tok_offsets`` / ``hid_offsets`` int64 [S + 1], ``prompt_lens`` int32 [S].

Shards are written atomically (the ``.jsonl`` last), so an interrupted run
resumes at the first missing shard.

The answers come from an *answerer*: ``VllmAnswerer`` here (the engine captures
the states while it decodes), or ``generate_hf.TransformersAnswerer`` for a GPU
machine without vLLM (generate, then one forward over prompt + answer). Both
hand ``generate_shards`` the same ``Answer`` records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vllm_treespec.jsonl import write_jsonl

FP16_MAX = 65504.0


def _engine_env(threads: str | None) -> None:
    # The capture hook needs the model runner in this process.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads)


def make_llm(target: str, *, max_num_seqs: int, max_model_len: int, seed: int,
             threads: str | None = None, **kw):
    _engine_env(threads)
    from vllm import LLM

    return LLM(
        target,
        dtype="float32",
        seed=seed,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(4096, max_model_len),
        # every prompt position must go through the model to be captured
        enable_prefix_caching=False,
        compilation_config={"mode": 0},
        **kw,
    )


def _model_runner(llm):
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None)
    if executor is None:  # newer engines keep it on the in-process core
        executor = engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


class HiddenStateCapture:
    """Wraps the runner's forward so every scheduled token's states are copied out.

    Tokens of a step are laid out request after request (``query_start_loc``)
    in ``input_batch.req_ids`` order. Chunks are keyed by position, so chunked
    prefill and recomputation after preemption simply overwrite.
    """

    def __init__(self, llm, aux_layers: tuple[int, ...]):
        self.runner = _model_runner(llm)
        inner = self.runner.model.model
        if not hasattr(inner, "aux_hidden_state_layers"):
            raise RuntimeError(f"{type(inner).__name__} cannot return auxiliary hidden states")
        inner.aux_hidden_state_layers = tuple(aux_layers)
        self.chunks: dict[str, list] = {}
        self.overflow = 0
        self.active = True
        self._orig = self.runner._model_forward
        self.runner._model_forward = self._forward

    def _forward(self, input_ids=None, positions=None, **kw):
        out = self._orig(input_ids=input_ids, positions=positions, **kw)
        hidden, aux = out
        if not self.active:
            return hidden
        runner = self.runner
        n = len(runner.input_batch.req_ids)
        qsl = runner.query_start_loc.np[: n + 1].copy()
        total = int(qsl[-1])
        packed, overflow = fp16_states(torch.stack([*aux, hidden], dim=1)[:total])
        self.overflow += overflow
        pos = positions[:total].numpy().copy()
        ids = input_ids[:total].numpy().copy()
        for i, rid in enumerate(runner.input_batch.req_ids[:n]):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if b > a:
                self.chunks.setdefault(rid, []).append((pos[a:b], ids[a:b], packed[a:b]))
        return hidden

    def pop(self, request_id: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Fed token ids and states for positions 0..n-1 of a finished request."""
        key = next((k for k in self.chunks if k == request_id or k.rsplit("-", 1)[0] == request_id), None)
        if key is None:
            raise KeyError(f"no captured states for request {request_id}")
        chunks = self.chunks.pop(key)
        width, d = chunks[0][2].shape[1:]
        hid = np.zeros((n, width, d), np.float16)
        ids = np.full(n, -1, np.int64)
        seen = np.zeros(n, bool)
        for pos, tok, states in chunks:
            keep = pos < n
            hid[pos[keep]] = states[keep]
            ids[pos[keep]] = tok[keep]
            seen[pos[keep]] = True
        if not seen.all():
            raise RuntimeError(f"request {request_id}: {int((~seen).sum())} positions were not captured")
        return ids, hid

    def clear(self) -> None:
        self.chunks.clear()


@dataclasses.dataclass
class Answer:
    """One answered prompt: its tokens and the states at every fed position."""

    prompt_ids: list[int]
    gen_ids: list[int]       # the answer, its stop token included
    text: str
    finish_reason: str       # "stop" or "length"
    fed_ids: np.ndarray      # [n] the tokens the states were computed on
    hidden: np.ndarray       # [n, A + 1, d] fp16 (n = len(prompt + answer) - 1)


class VllmAnswerer:
    """Answers through an in-process vLLM engine, capturing states as it decodes."""

    def __init__(self, llm, aux_layers: tuple[int, ...]):
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.llm_engine.model_config.max_model_len
        self.capture = HiddenStateCapture(llm, aux_layers)

    @property
    def overflow(self) -> int:
        return self.capture.overflow

    def sample(self, texts: list[str], temperature: float, max_tokens: int,
               stop: str | None = None) -> list[tuple[str, str]]:
        """(text, finish reason) per prompt, no states kept."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                stop=[stop] if stop else None)
        self.capture.active = False
        try:
            outputs = self.llm.generate(texts, params, use_tqdm=True)
        finally:
            self.capture.active = True
        return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]

    def answer(self, texts: list[str], settings: list[tuple[float, int]]) -> list[Answer]:
        """``settings``: (temperature, max new tokens) per text."""
        from vllm import SamplingParams

        params = [SamplingParams(temperature=t, max_tokens=m) for t, m in settings]
        self.capture.clear()
        answers = []
        for out in self.llm.generate(texts, params, use_tqdm=False):
            prompt_ids, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
            ids, hid = self.capture.pop(out.request_id, len(prompt_ids) + len(gen) - 1)
            answers.append(Answer(prompt_ids, gen, out.outputs[0].text,
                                  out.outputs[0].finish_reason, ids, hid))
        return answers


def fp16_states(packed: torch.Tensor) -> tuple[np.ndarray, int]:
    """States as stored in a shard (fp16, clamped) and how many values overflowed."""
    big = packed.abs() > FP16_MAX
    overflow = int(big.sum())
    if overflow:
        packed = packed.clamp(-FP16_MAX, FP16_MAX)
    return packed.to(torch.float16).cpu().numpy(), overflow


def sampling_for(prompt_id: str, seed: int, greedy_frac: float,
                 temperatures: list[float]) -> float:
    """Per-prompt sampling temperature (0: greedy), deterministic in (seed, prompt id).

    Sampled answers use plain temperature sampling from the engine's seeded
    generator: per-request seeds and top-p each cost vLLM's CPU sampler a
    large share of its throughput at large batches (per-request seeds the
    most, both together more still), and answer generation runs at batch 64.
    """
    rng = random.Random(f"{seed}:{prompt_id}")
    if rng.random() < greedy_frac:
        return 0.0
    return rng.choice(temperatures)


def shard_paths(data_dir: Path, index: int) -> tuple[Path, Path]:
    return data_dir / f"shard_{index:05d}.safetensors", data_dir / f"shard_{index:05d}.jsonl"


def generate_shards(
    answerer,
    prompts: list[dict],
    data_dir: Path,
    *,
    aux_layers: tuple[int, ...],
    seed: int,
    max_tokens: int,
    greedy_frac: float,
    temperatures: list[float],
    shard_size: int,
    first_shard: int = 0,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
    shard_seconds: float = 0.0,
) -> dict:
    """Answer ``prompts`` shard by shard with ``answerer`` (``VllmAnswerer`` or
    ``TransformersAnswerer``), skipping shards already on disk.

    With a ``deadline`` (``time.time()`` value), no shard is started that would
    not finish before it, by the mean of ``shard_seconds`` (earlier invocations)
    and this invocation's shards; ``stats["stopped"]`` then says so."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = answerer.tokenizer
    max_len = answerer.max_model_len
    stats = {"tokens": 0, "new_tokens": 0, "seconds": 0.0, "shards": 0, "skipped": 0,
             "stopped": False}
    blocks = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
    bar = tqdm(total=len(blocks), desc="generate", unit="shard")
    for b, block in enumerate(blocks):
        index = first_shard + b
        st_path, meta_path = shard_paths(data_dir, index)
        if meta_path.exists() and st_path.exists():
            bar.update(1)
            continue
        expected = stats["seconds"] / stats["shards"] if stats["shards"] else shard_seconds
        if deadline is not None and time.time() + expected > deadline:
            stats["stopped"] = True
            log(f"[generate] stopping before shard {index}: ~{expected:.0f}s left no room")
            break
        texts, settings, kept = [], [], []
        for p in block:
            text = tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            n_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n_prompt + 16 > max_len:
                stats["skipped"] += 1
                continue
            t = sampling_for(p["id"], seed, greedy_frac, temperatures)
            texts.append(text), settings.append((t, min(max_tokens, max_len - n_prompt)))
            kept.append(p)
        t0 = time.time()
        answers = answerer.answer(texts, settings)
        dt = time.time() - t0
        tok_list, hid_list, meta = [], [], []
        tok_off, hid_off, plens = [0], [0], []
        for p, (t, _), a in zip(kept, settings, answers):
            full = np.asarray(a.prompt_ids + a.gen_ids, np.int64)
            n = len(full) - 1  # the last token is sampled, never fed
            if not np.array_equal(a.fed_ids, full[:n]) or a.hidden.shape[0] != n:
                raise RuntimeError(f"captured tokens of {p['id']} do not match its output")
            tok_list.append(full.astype(np.int32))
            hid_list.append(a.hidden)
            tok_off.append(tok_off[-1] + len(full))
            hid_off.append(hid_off[-1] + n)
            plens.append(len(a.prompt_ids))
            meta.append({
                "id": p["id"], "kind": p["kind"], "messages": p["messages"], "temperature": t,
                "prompt_len": len(a.prompt_ids), "new_tokens": len(a.gen_ids),
                "finish_reason": a.finish_reason, "response": a.text,
            })
            stats["tokens"] += n
            stats["new_tokens"] += len(a.gen_ids)
        tensors = {
            "tokens": np.concatenate(tok_list),
            "hidden": np.concatenate(hid_list),
            "tok_offsets": np.asarray(tok_off, np.int64),
            "hid_offsets": np.asarray(hid_off, np.int64),
            "prompt_lens": np.asarray(plens, np.int32),
        }
        tmp = st_path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"aux_layers": json.dumps(list(aux_layers))})
        tmp.replace(st_path)
        write_jsonl(meta_path, meta)  # last: a shard counts as done once this exists
        stats["seconds"] += dt
        stats["shards"] += 1
        new = sum(m["new_tokens"] for m in meta)
        log(f"[generate] shard {index}: {len(meta)} seqs, {new} new tokens in {dt:.0f}s "
            f"({new / dt:.0f} tok/s), fp16 overflow so far {answerer.overflow}")
        bar.update(1)
    bar.close()
    stats["overflow"] = answerer.overflow
    return stats


def generate_self_queries(answerer, n: int, seed: int, temperature: float = 0.9,
                          max_tokens: int = 128) -> list[str]:
    """User turns written by the target from the bare user-turn prefix (``seed``
    is the answerer's: it was seeded when it was made)."""
    from .prompts import clean_self_query, self_query_prefix

    prefix = self_query_prefix(answerer.tokenizer)
    end = "<|im_end|>" if "<|im_end|>" in prefix or "<|im_start|>" in prefix else None
    out = []
    for text, finish in answerer.sample([prefix] * n, temperature, max_tokens, stop=end):
        if finish != "stop":
            continue  # unfinished queries are cut mid-sentence
        q = clean_self_query(text)
        if q:
            out.append(q)
    return list(dict.fromkeys(out))
