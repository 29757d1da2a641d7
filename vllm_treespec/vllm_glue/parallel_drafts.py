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
A mixin of ``TreeEagleProposer``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context

from vllm_treespec.attention import DraftTreeLevelMetadata
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


class ParallelDrafting:
    slot_state: torch.Tensor | None = None  # fc(mask_hidden), [1, d]; None: sequential
    pard_token: int = 0

    def _load_parallel_state(self) -> None:
        draft = self.draft_model_config
        self.pard_token = int(draft.hf_config.pard_token)  # checked at startup (support)
        mask = read_mask_hidden(draft.model, draft.revision,
                                self.vllm_config.load_config.download_dir)
        dtype = self.vllm_config.model_config.dtype
        with torch.no_grad():
            self.slot_state = self.model.combine_hidden_states(
                mask.to(self.device, dtype).reshape(1, -1))

    def _parallel_marginals(self, batch_size: int, slots: int, prefix_len: torch.Tensor,
                            max_prefix: int, block_table: torch.Tensor, side_capacity: int,
                            scratch: dict) -> torch.Tensor:
        """[B, slots, V] draft log-probs of depths 2 .. slots + 1, one forward."""
        n = batch_size * slots
        offsets = torch.arange(slots, device=self.device)
        positions = (prefix_len.unsqueeze(1) + offsets).clamp(max=self.max_model_len - 1)
        causal = torch.ones(slots, slots, dtype=torch.bool, device=self.device).tril()
        md = DraftTreeLevelMetadata(
            batch_size=batch_size, width=slots, side_offset=0,
            side_capacity=max(side_capacity, slots), prefix_len=prefix_len,
            max_prefix_len=max_prefix, block_table=block_table, block_size=self.block_size,
            side_mask=causal.expand(batch_size, slots, slots).contiguous(), scratch=scratch)
        ids = torch.full((n,), self.pard_token, dtype=torch.int32, device=self.device)
        with set_forward_context({name: md for name in self._draft_attn_layer_names},
                                 self.vllm_config, num_tokens=n,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE, slot_mapping={}):
            last_hidden, _ = self.model(input_ids=ids, positions=positions.reshape(n),
                                        hidden_states=self.slot_state.expand(n, -1).contiguous())
        return self._draft_vocab_logprobs(last_hidden).view(batch_size, slots, -1)
