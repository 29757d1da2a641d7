"""Self-distillation data without vLLM: transformers answers, then one forward
over prompt + answer captures the states (for a GPU machine that has torch and
transformers but no vLLM; see scripts/train-drafter-cuda.sh).

The shards are those of ``generate.VllmAnswerer``: at every fed position, the
residual stream entering each auxiliary layer L (``hidden_states[L]`` in
transformers, what vLLM's Llama hands the drafter for layer id L) and the final
normed state (``hidden_states[-1]``), in fp16. ``tests/train/test_generate_hf.py``
checks them against the vLLM capture on the same tokens.

Sampling: greedy, or plain temperature sampling (no top-k, no top-p), as the
vLLM stage samples. An answer ends at the target's end-of-turn token, which it
keeps as its last (sampled, never fed) token, or at its ``max_tokens``.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .generate import Answer, fp16_states


class TransformersAnswerer:
    def __init__(self, target: str, aux_layers: tuple[int, ...], *, max_model_len: int,
                 batch: int, seed: int, device: str | None = None,
                 capture_batch: int = 16):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        # fp32, as the vLLM stage runs the target: the states are training inputs.
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        self.model.to(self.device).eval()
        layers = self.model.config.num_hidden_layers
        if not all(0 < layer < layers for layer in aux_layers):
            raise ValueError(f"aux layers {aux_layers} outside 1..{layers - 1}")
        self.aux_layers = tuple(aux_layers)
        self.max_model_len = max_model_len
        self.batch, self.capture_batch = batch, capture_batch
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = self.tokenizer.pad_token_id
        if self.pad is None:
            self.pad = min(self.eos)
        self.overflow = 0
        torch.manual_seed(seed)

    def answer(self, texts: list[str], settings: list[tuple[float, int]]) -> list[Answer]:
        """``settings``: (temperature, max new tokens) per text; answers in order."""
        prompts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        answers: list[Answer | None] = [None] * len(texts)
        # Batches share a temperature; sorting by length keeps the padding small.
        order = sorted(range(len(texts)), key=lambda i: (settings[i][0], len(prompts[i])))
        for temp, group in itertools.groupby(order, key=lambda i: settings[i][0]):
            group = list(group)
            for k in range(0, len(group), self.batch):
                rows = group[k: k + self.batch]
                gens = self._generate([prompts[i] for i in rows], temp,
                                      [settings[i][1] for i in rows])
                for i, gen in zip(rows, gens):
                    answers[i] = gen
        full = [prompts[i] + answers[i][0] for i in range(len(texts))]
        states = self._capture(full)
        out = []
        for i, (gen, finish) in enumerate(answers):
            fed = np.asarray(full[i][:-1], np.int64)
            out.append(Answer(prompts[i], gen, self.tokenizer.decode(gen, skip_special_tokens=True),
                              finish, fed, states[i]))
        return out

    def sample(self, texts: list[str], temperature: float, max_tokens: int,
               stop: str | None = None) -> list[tuple[str, str]]:
        """(text, finish reason) per prompt, no states; ``stop`` must be one token."""
        stops = set(self.eos)
        if stop is not None:
            ids = self.tokenizer(stop, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"stop {stop!r} is {len(ids)} tokens; one is supported")
            stops.add(ids[0])
        prompts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        out = []
        for k in range(0, len(prompts), self.batch):
            for gen, finish in self._generate(prompts[k: k + self.batch], temperature,
                                              [max_tokens] * len(prompts[k: k + self.batch]),
                                              stops):
                out.append((self.tokenizer.decode(gen, skip_special_tokens=True), finish))
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], temperature: float,
                  max_tokens: list[int], stops: set[int] | None = None
                  ) -> list[tuple[list[int], str]]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding: every answer starts at column `width`
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
            if temperature > 0 else {"do_sample": False}
        seqs = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=max(max_tokens), eos_token_id=sorted(stops or self.eos),
            pad_token_id=self.pad, **sampling)
        out = []
        for row, limit in zip(seqs[:, width:].tolist(), max_tokens):
            row = row[:limit]
            stop = next((j for j, t in enumerate(row) if t in (stops or self.eos)), None)
            out.append((row[: stop + 1], "stop") if stop is not None else (row, "length"))
        return out

    @torch.no_grad()
    def _capture(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """[n, A + 1, d] fp16 states of each sequence's fed tokens (all but the last)."""
        states = []
        for k in range(0, len(sequences), self.capture_batch):
            fed = [s[:-1] for s in sequences[k: k + self.capture_batch]]
            width = max(map(len, fed))
            ids = torch.full((len(fed), width), self.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, s in enumerate(fed):  # right padding: positions 0..n-1 as in vLLM
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
            # The decoder alone: no vocabulary-wide logits, no KV cache.
            hs = self.model.model(input_ids=ids.to(self.device),
                                  attention_mask=mask.to(self.device), use_cache=False,
                                  output_hidden_states=True).hidden_states
            packed = torch.stack([hs[layer] for layer in self.aux_layers] + [hs[-1]], dim=2)
            for r, s in enumerate(fed):
                arr, overflow = fp16_states(packed[r, : len(s)])
                self.overflow += overflow
                states.append(arr)
        return states
