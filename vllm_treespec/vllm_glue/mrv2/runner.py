"""The tree runner on MRV2: vLLM's CPU ``CPUModelRunner`` (a ``GPUModelRunner``) with
the tree speculator, the model-state wrapper and the tree rejection sampler.

Overridden (docs/architecture.md): ``__init__`` (0.32.0's ``init_speculator`` has no
seam for a method's class, so the speculator is replaced after it; 0.34+ builds
ours from the registered config, and the runner adopts its step state), ``load_model``
(the model state and the rejection sampler are the model's, built there), and
``initialize_kv_cache`` (the block size the tree rows and the commit use)."""

from __future__ import annotations

import logging

import torch

from vllm_treespec.attention.cpu_layout import move_cache_slots
from vllm_treespec.vllm_glue.mrv2.checks import check_mrv2_tree
from vllm_treespec.vllm_glue.mrv2.model_state import TreeModelState
from vllm_treespec.vllm_glue.mrv2.sampler import TreeRejectionSampler
from vllm_treespec.vllm_glue.mrv2.speculator import TreeEagleSpeculator
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

logger = logging.getLogger("vllm.treespec")


class _TreeMRV2Runner:
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.tree_cfg = tree_config_from_vllm(vllm_config)
        check_mrv2_tree(self.tree_cfg)
        if isinstance(self.speculator, TreeEagleSpeculator):
            # 0.34+: vLLM built it from the registered method's config
            # (registration); its step state becomes the runner's.
            self.tree_steps = self.speculator.steps
            self.tree_steps.move_kv = self._move_kv
        else:
            self.tree_steps = TreeSteps(self._move_kv)
            if self.speculator is not None:  # the last pipeline stage's (no others: support)
                self.speculator = TreeEagleSpeculator(vllm_config, self.device,
                                                      self.tree_cfg, self.tree_steps)
        logger.info("eagle3_tree: Model Runner V2 (%s), fixed trees of %d nodes",
                    type(self).__mro__[2].__qualname__, self.tree_cfg.num_nodes)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if self.rejection_sampler is None:
            return
        draft_layers = set(getattr(self.speculator, "draft_attn_layer_names", ()) or ())
        self.model_state = TreeModelState(self.model_state, self.tree_steps, draft_layers,
                                          self._tree_block_size)
        self.rejection_sampler = TreeRejectionSampler(self.rejection_sampler, self.sampler,
                                                      self.tree_steps)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        manager, kernel = self.block_tables.block_sizes[0], self.kernel_block_sizes[0]
        if len(self.block_tables.block_sizes) != 1 or manager != kernel:
            # The tree rows and the commit address the cache through MRV2's block
            # tables, in the KV manager's blocks.
            raise NotImplementedError(
                f"eagle3_tree on MRV2: KV-cache groups {self.block_tables.block_sizes} "
                f"with kernel blocks {self.kernel_block_sizes}; one group whose kernel "
                f"block is the manager's is supported")

    def _tree_block_size(self) -> int:
        return self.block_tables.block_sizes[0]

    def _move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV of (block, offset) pairs ``src`` [N, 2] copied to ``dst`` in every
        layer's cache (each storage once), all read before any is written."""
        move_cache_slots(self.kv_caches, src, dst)


def tree_mrv2_runner_class(base: type) -> type:
    return type("TreeMRV2CPUModelRunner", (_TreeMRV2Runner, base), {})
