"""The CPU model runner: the tree mixin plus the CPU's KV-cache layout, scratch
blocks for verifying trees as chains (``chain_split``), and linear layers that
verify a few tokens at close to one token's cost (``cpu_linear``)."""

from __future__ import annotations

import logging

import torch

from vllm_treespec.attention.cpu_layout import kv_views, move_cache_slots
from vllm_treespec.vllm_glue import cpu_linear, versions
from vllm_treespec.vllm_glue.runner import TreeRunnerMixin, distinct_kv_caches

logger = logging.getLogger("vllm.treespec")


class _CPUDevice:
    """The CPU parts: the KV-cache layout, scratch blocks for verifying trees as
    chains (``chain_split``), and linear layers that verify a few tokens at close
    to one token's cost (``cpu_linear``)."""

    # Blocks reserved past the scheduler's in every layer's cache: enough for a
    # batch-1 tree of 8 branches (a branch whose path crosses a block boundary
    # takes two). A step that needs more verifies its trees with torch instead.
    SPARE_BLOCKS = 8
    # One-wide drafting levels run as stock EAGLE chain steps: the native kernel
    # over the paged cache (``paged_drafts.PagedForwards.chain_level``). Not on Ascend:
    # vllm-ascend's drafting metadata for that path is unverified without an NPU.
    paged_chain_levels = True
    chains_need_tree_metadata = False  # chain-only steps run the native kernel alone

    def _kv_views(self, cache: torch.Tensor):
        return kv_views(cache, cache.shape[-1] // 2)

    def _move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Two indexing ops a layer on the flat cache (K and V of every head at
        once; per view, K's transposed layout made it ten)."""
        move_cache_slots((c for c, _ in distinct_kv_caches(self.kv_caches, self._kv_views)),
                         src, dst)

    def _tree_attention_backend(self) -> type:
        from vllm_treespec.vllm_glue.cpu_attention import TreeCPUAttentionBackend

        return TreeCPUAttentionBackend

    def initialize_kv_cache_tensors(self, kv_cache_config, *args, **kwargs):
        """vLLM sizes each layer's cache by the scheduler's block count; we add
        ``SPARE_BLOCKS`` pages at the end, which the scheduler never hands out
        (only this allocation sees the grown config; see
        ``versions.grow_kv_cache_config``)."""
        grown = versions.grow_kv_cache_config(kv_cache_config, self.SPARE_BLOCKS)
        if grown is None:  # packed layouts: none
            return super().initialize_kv_cache_tensors(kv_cache_config, *args, **kwargs)
        config, self._spare_bytes = grown
        return super().initialize_kv_cache_tensors(config, *args, **kwargs)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        num = kv_cache_config.num_blocks
        shapes = {tuple(c.shape) for c in self.kv_caches if c is not None}
        if getattr(self, "_spare_bytes", 0) and all(s[0] == num + self.SPARE_BLOCKS
                                                    for s in shapes):
            self.tree_spare_blocks = list(range(num, num + self.SPARE_BLOCKS))
            logger.info("eagle3_tree: %d spare KV blocks (%.1f MiB) verify trees as chains "
                        "with the native attention kernel", self.SPARE_BLOCKS,
                        self._spare_bytes / 2**20)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if cpu_linear.enabled():
            models = [self.model] + ([self.drafter.model] if hasattr(self, "drafter") else [])
            dtype = self.model_config.dtype
            self._small_m_layers = cpu_linear.install(models, dtype)
            if not self._small_m_layers:
                return
            # Before compilation: a dispatcher that never picks W @ x^T only costs.
            rows, timings = cpu_linear.calibrate(cpu_linear.layer_timer(models, dtype))
            if not rows and not cpu_linear.kept_whatever_the_timings():
                cpu_linear.uninstall(models)
                self._small_m_layers = 0
                logger.info("eagle3_tree: linear layers keep oneDNN's kernels (faster here "
                            "for every row count; layer ms oneDNN/W @ x^T by rows: %s)",
                            _timings_text(timings))

    def _calibrate_kernels(self) -> None:
        if not getattr(self, "_small_m_layers", 0):
            return
        limit = self.scheduler_config.max_num_batched_tokens
        rows, timings = cpu_linear.calibrate(lambda n: self._time_forward(n, repeats=1),
                                             range(2, min(cpu_linear.MAX_ROWS, limit) + 1))
        logger.info("eagle3_tree: %d linear layers use W @ x^T for %s-row inputs; forward "
                    "ms oneDNN/W @ x^T by rows: %s", self._small_m_layers, rows or "no",
                    _timings_text(timings))


def _timings_text(timings: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{n}: {1e3 * a:.1f}/{1e3 * b:.1f}" for n, (a, b) in timings.items())


def tree_cpu_runner_class(base: type) -> type:
    return type("TreeCPUModelRunner", (_CPUDevice, TreeRunnerMixin, base), {})
