"""Parallel drafting (P-EAGLE): a whole tree from one drafter forward.

A head trained for parallel drafting (``vllm-treespec train-drafter --parallel
K``; config.json ``pard_token``, weights ``mask_hidden``) predicts the tokens at
several depths at once. After the first pass (which gives depth 1, as always),
each request gets ``depth - 1`` slots at positions ``P' .. P' + depth - 2``
(those of the tree's depth-2.. nodes), input token ``pard_token`` and state
``fc(mask_hidden)``, causal among themselves and over the committed prefix —
vLLM's own parallel-drafting layout. They run as one tree level (side buffer,
lower-triangular mask), so every device's level attention serves them. Slot d's
output is the marginal of depth d + 1; the tree builder then expands every
frontier node with its depth's marginal, ranking paths by the product of the
marginals (as Medusa-style trees do), with no further forward.

vLLM loads ``mask_hidden`` only for its own ``parallel_drafting`` chains, which
would also reshape the first pass; the tree reads it from the checkpoint here.
The level strategy of a ``"draft": "parallel"`` drafter (``draft_levels``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_treespec.engine.levels import LevelsRun, LevelStep
from vllm_treespec.vllm_glue.draft_levels import side_buffer_forward
from vllm_treespec.vllm_glue.support import NOT_A_PARALLEL_HEAD, bad_drafter


def read_mask_hidden(model: str, revision: str | None = None,
                     cache_dir: str | None = None) -> torch.Tensor:
    """The ``mask_hidden`` tensor of a drafter checkpoint: a local directory, or the
    hub snapshot vLLM has just loaded (same revision and cache; no download)."""
    from safetensors import safe_open

    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=["*.safetensors", "*.json"],
                                      local_files_only=True))
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as weights:
            if "mask_hidden" in weights.keys():
                return weights.get_tensor("mask_hidden")
    raise bad_drafter(path, NOT_A_PARALLEL_HEAD)


class ParallelLevels:
    def __init__(self, drafter):
        """Read the head's slot state (after the drafter's weights are loaded)."""
        self.drafter = drafter
        draft = drafter.draft_model_config
        self.pard_token = int(draft.hf_config.pard_token)  # checked at startup (support)
        mask = read_mask_hidden(draft.model, draft.revision,
                                drafter.vllm_config.load_config.download_dir)
        dtype = drafter.vllm_config.model_config.dtype
        with torch.no_grad():  # fc(mask_hidden), [1, d]
            self.slot_state = drafter.model.combine_hidden_states(
                mask.to(drafter.device, dtype).reshape(1, -1))

    def grow(self, builder, level, parent_hidden: torch.Tensor, step: LevelStep) -> LevelsRun:
        t0 = time.perf_counter()
        run = LevelsRun(sequential=False)
        if not builder.done:
            marginals = self.marginals(step, step.depth - 1)
            run.levels, run.nodes_forwarded = 1, step.batch_size * (step.depth - 1)
            builder.grow_from_marginals(level, marginals, step.width)  # the builder is done
        run.seconds = time.perf_counter() - t0
        return run

    def marginals(self, step: LevelStep, slots: int) -> torch.Tensor:
        """[B, slots, V] draft log-probs of depths 2 .. slots + 1, one forward."""
        d = self.drafter
        B = step.batch_size
        n = B * slots
        offsets = torch.arange(slots, device=d.device)
        positions = (step.prefix_len.unsqueeze(1) + offsets).clamp(max=d.max_model_len - 1)
        causal = torch.ones(slots, slots, dtype=torch.bool, device=d.device).tril()
        ids = torch.full((n,), self.pard_token, dtype=torch.int32, device=d.device)
        last_hidden, _ = side_buffer_forward(
            d, step, slots, 0, max(step.side_capacity, slots),
            causal.expand(B, slots, slots).contiguous(), input_ids=ids,
            positions=positions.reshape(n),
            hidden_states=self.slot_state.expand(n, -1).contiguous())
        return d.draft_vocab_logprobs(last_hidden).view(B, slots, -1)
