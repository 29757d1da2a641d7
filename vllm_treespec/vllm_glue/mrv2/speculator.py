"""The EAGLE-3 drafter on MRV2, drafting a tree.

``propose`` commits the previous verify step's accepted path first (MRV2 calls it
right after ``post_update``; the drafter's prefill shifts the verify step's input ids
and reads its hidden states row by row, so they must already be the accepted chain),
then runs vLLM's own drafting for ``levels`` levels: ``_prefill`` over the verify rows
(the target's attention metadata and slots), then one-query-per-request decode steps
along the best path. ``sample_draft`` keeps each level's top-k, whose lower ranks
become the siblings of the chain's node at that level (``shapes``)."""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

from vllm_treespec.config import TreeSpecConfig
from vllm_treespec.tree.proposed import ProposedTree
from vllm_treespec.vllm_glue.mrv2.shapes import chain_with_siblings, levels_needed
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps


class TreeEagleSpeculator(EagleSpeculator):
    def __init__(self, vllm_config, device, tree_cfg: TreeSpecConfig, steps: TreeSteps):
        super().__init__(vllm_config, device)
        self.tree_cfg, self.steps = tree_cfg, steps
        self._level_top: list[torch.Tensor] = []

    def sample_draft(self, hidden_states, sample_src_positions, idx_mapping, temperature,
                     seeds, draft_step, draft_logits, spec_step_idx: int = 0):
        # Tree drafts are the drafter's top-k at every temperature: acceptance verifies
        # each node as a proposal, losslessly, whichever tokens they are.
        logits = self.compute_draft_logits(hidden_states, spec_step_idx)
        top = logits.topk(min(self.tree_cfg.top_k, logits.shape[-1]), dim=-1).indices
        self._level_top.append(top)
        return top[:, 0]

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        if not dummy_run:
            self.steps.commit(input_batch, last_hidden_states, aux_hidden_states)
        num_nodes = (self.num_speculative_steps if num_speculative_tokens is None
                     else num_speculative_tokens)
        levels = levels_needed(num_nodes, self.tree_cfg.depth)
        self._level_top = []
        chain = super().propose(
            input_batch, attn_metadata, slot_mappings, last_hidden_states,
            aux_hidden_states, num_sampled, num_rejected, last_sampled,
            next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
            dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run,
            mm_inputs=mm_inputs, is_profile=is_profile, num_speculative_tokens=levels)
        num_reqs = input_batch.num_reqs
        if num_nodes == 0 or not self._level_top:
            return chain
        # Each level's top-k, [num_reqs, levels, K]; the stock chain is rank 0.
        top = torch.stack([t[:num_reqs] for t in self._level_top], dim=1)
        drafts = torch.full((num_reqs, self.num_speculative_steps), -1,
                            dtype=self.draft_tokens.dtype, device=self.draft_tokens.device)
        tokens, parents = chain_with_siblings(top, num_nodes)
        drafts[:, :num_nodes] = tokens.to(drafts.dtype)
        if not dummy_run:
            for b, toks in zip(input_batch.idx_mapping_np[:num_reqs].tolist(), tokens.tolist()):
                self.steps.proposed[int(b)] = ProposedTree(toks, parents, [0.0] * num_nodes)
        return drafts
