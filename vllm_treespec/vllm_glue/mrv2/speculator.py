"""The EAGLE-3 drafter on MRV2, growing a dynamic tree.

``propose`` commits the previous verify step's accepted path first (MRV2 calls it
right after ``post_update``; the drafter's first pass shifts the verify step's input
ids and reads its hidden states row by row, so they must already be the accepted
chain). Then vLLM's own first pass alone (``propose`` with one speculative token:
``_prefill`` over the verify rows, on the target's attention metadata and slots),
whose ``sample_draft`` keeps the log-probabilities after each new root. The levels
below run through the engine's level loop (``trees.grow_trees``) on ``TreeLevels``,
and the BFS trees go to MRV2 as ``[num_reqs, N]`` drafts."""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

from vllm_treespec.attention import DraftTreeLevelMetadata
from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.engine.levels import LevelStep
from vllm_treespec.vllm_glue.mrv2.checks import check_mrv2_tree
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps
from vllm_treespec.vllm_glue.mrv2.trees import grow_trees, level_step, tree_drafts
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm


class TreeEagleSpeculator(EagleSpeculator):
    def __init__(self, vllm_config, device, tree_cfg: TreeSpecConfig, steps: TreeSteps):
        super().__init__(vllm_config, device)
        self.tree_cfg, self.steps = tree_cfg, steps
        self.levels = TreeLevels(self)
        self._root_logprobs: torch.Tensor | None = None

    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the drafter's own (reduced) vocabulary."""
        logits = self.model.logits_processor(self.model.lm_head, hidden)
        return torch.log_softmax(logits.float(), dim=-1)

    def token_map(self) -> torch.Tensor | None:
        """Draft-vocabulary id -> target id (EAGLE-3's ``d2t`` holds the offsets)."""
        d2t = getattr(self.model, "draft_id_to_target_id", None)
        if d2t is None:
            return None
        cached = getattr(self, "_token_map_cache", None)
        if cached is None or cached.shape[0] != d2t.shape[0]:
            cached = self._token_map_cache = torch.arange(d2t.shape[0],
                                                          device=d2t.device) + d2t.long()
        return cached

    def sample_draft(self, hidden_states, sample_src_positions, idx_mapping, temperature,
                     seeds, draft_step, draft_logits, spec_step_idx: int = 0,
                     num_steps: int = 1):  # num_steps: 0.34's multi-step draws (unused)
        # The first pass's only draw: the roots' log-probabilities seed the trees.
        # Tree drafts are the drafter's best candidates at every temperature:
        # acceptance verifies each node as a proposal, losslessly.
        logprobs = self.draft_vocab_logprobs(hidden_states)
        self._root_logprobs = logprobs
        best = logprobs.argmax(dim=-1)
        token_map = self.token_map()
        return token_map[best] if token_map is not None else best

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
        self._root_logprobs = None
        first = super().propose(
            input_batch, attn_metadata, slot_mappings, last_hidden_states,
            aux_hidden_states, num_sampled, num_rejected, last_sampled,
            next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
            dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run,
            mm_inputs=mm_inputs, is_profile=is_profile,
            num_speculative_tokens=min(num_nodes, 1))
        # A dummy run's batch has no block table of its own (the levels read the
        # verify step's), and its drafts are dropped.
        if dummy_run or num_nodes == 0 or self._root_logprobs is None:
            return first
        return self._tree_drafts(input_batch, num_rejected, num_nodes)

    def _tree_drafts(self, input_batch, num_rejected: torch.Tensor,
                     num_nodes: int) -> torch.Tensor:
        B = input_batch.num_reqs
        # The new root sits where the rejected drafts began: the drafter's KV (its
        # first pass over the accepted chain) is valid below it.
        prefix_len = input_batch.seq_lens[:B].long() - num_rejected[:B].long()
        step = level_step(self.tree_cfg, prefix_len, self.steps.block_table[:B])
        # _prefill left each root (the drafter's last input) and the drafter's
        # hidden state there in its buffers.
        roots = self.input_buffers.input_ids[self.last_token_indices[:B]]
        parent_hidden = self.hidden_states[:B].clone().unsqueeze(1)
        trees = grow_trees(self.tree_cfg, self.levels, self._root_logprobs[:B],
                           parent_hidden, step, roots, num_nodes, self.token_map())
        drafts, proposed = tree_drafts(trees, self.num_speculative_steps)
        for b, tree in zip(input_batch.idx_mapping_np[:B].tolist(), proposed):
            self.steps.proposed[int(b)] = tree
        self.steps.counters["drafted_trees"] += B
        return drafts.to(self.draft_tokens.dtype)


def _kv_move_unbound(src: torch.Tensor, dst: torch.Tensor) -> None:
    raise TreeSpecConfigError("eagle3_tree: the tree speculator runs without the tree "
                              "runner, which binds the KV move")


class RegisteredTreeSpeculator(TreeEagleSpeculator):
    """The class vLLM 0.34+ builds by name (``method_config``'s ``speculator_class``,
    through ``init_speculator``), with the ``(vllm_config, device)`` every speculator
    takes: the tree settings are read from the engine config here, and the step
    state is created here; the tree runner adopts it (``runner._TreeMRV2Runner``) and
    binds the KV move, which needs the runner's caches. On 0.32.0 the runner builds
    ``TreeEagleSpeculator`` itself (``init_speculator`` has no seam there)."""

    def __init__(self, vllm_config, device):
        tree_cfg = tree_config_from_vllm(vllm_config)
        check_mrv2_tree(tree_cfg)
        super().__init__(vllm_config, device, tree_cfg, TreeSteps(_kv_move_unbound))

    def load_model(self, target_model) -> None:
        # The runner's __init__ (which built this speculator) ran before load_model.
        if self.steps.move_kv is _kv_move_unbound:
            raise TreeSpecConfigError(
                "eagle3_tree: vLLM built the tree speculator under a runner other than "
                "the tree runner (the worker did not build it); its trees would be "
                "verified as chains, and their accepted paths never committed")
        super().load_model(target_model)

    def add_request(self, req_index: int) -> None:
        """0.34's lifecycle hook: a new request in this request-state slot has no
        proposed tree yet (a stale one would only be verified as a chain)."""
        self.steps.proposed.pop(int(req_index), None)

    def reset_state(self) -> None:
        """0.34's hook after the warm-up requests: forget their trees."""
        self.steps.proposed.clear()


class TreeLevels:
    """MRV2's ``engine.levels.LevelForwards``: a level's frontier through the
    drafter under vLLM's forward context, with ``DraftTreeLevelMetadata`` for the
    drafter's attention layers (the tree backend's draft-level path: the paged
    prefix plus a side buffer) and no slot mapping, so nothing of the draft tree is
    written to the paged cache, as V1's ``draft_levels.side_buffer_forward``."""

    def __init__(self, speculator: TreeEagleSpeculator):
        self.spec = speculator

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.spec.draft_vocab_logprobs(hidden)

    def side_level(self, step: LevelStep, width: int, side_offset: int,
                   side_mask: torch.Tensor, **inputs):
        spec = self.spec
        md = DraftTreeLevelMetadata(
            batch_size=step.batch_size, width=width, side_offset=side_offset,
            side_capacity=step.side_capacity, prefix_len=step.prefix_len,
            max_prefix_len=step.max_prefix, block_table=step.block_table,
            block_size=spec.steps.block_size, side_mask=side_mask, scratch=step.scratch)
        with set_forward_context({name: md for name in spec.draft_attn_layer_names},
                                 spec.vllm_config, num_tokens=step.batch_size * width,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE, slot_mapping={}):
            out = spec.model(**inputs)
        return out if isinstance(out, tuple) else (out, out)
