"""The tree runner on vllm-ascend: ``NPUModelRunner`` + the device-agnostic
``TreeRunnerMixin``, joined by small MRO shims.

Owns :func:`tree_npu_runner_class` (the worker swaps the class it returns in for
``init_device`` only, as the CPU worker does) and the shims that adapt the KV
layout, the drafter class and ``_prepare_inputs``'s return value, reserve the
tree buffers in the profiling run and check, once the KV cache exists, that every
layer runs the tree backend. Imports :mod:`.checks`, :mod:`.backend` and
:mod:`.proposer`; the mixin lazily.
"""

from __future__ import annotations

import logging

from vllm_treespec.vllm_glue.ascend import checks
from vllm_treespec.vllm_glue.ascend.backend import (
    TreeAscendAttentionBackend,
    TreeAscendAttentionImpl,
    kv_pair,
    reserve_for_profiling,
)
from vllm_treespec.vllm_glue.ascend.proposer import tree_ascend_proposer_class

logger = logging.getLogger("vllm.treespec")


def _attention_layers(vllm_config) -> dict:
    return vllm_config.compilation_config.static_forward_context


class _NPURunnerKVLayout:
    def _kv_views(self, cache):
        return kv_pair(cache)

    def _tree_attention_backend(self) -> type:
        return TreeAscendAttentionBackend

    def _tree_proposer_class(self) -> type:
        return tree_ascend_proposer_class()


class _NPUPrepareInputsOuter:
    """NPUModelRunner._prepare_inputs returns (logits_indices, spec_metadata,
    total_tokens); the tree mixin speaks vLLM's two-value form. This class sits
    outside the mixin and restores the third value for NPUModelRunner's caller."""

    def _prepare_inputs(self, *args, **kwargs):
        logits_indices, spec_md = super()._prepare_inputs(*args, **kwargs)
        return (logits_indices, spec_md, *self._npu_prepare_extra)


class _NPUPrepareInputsInner:
    """Sits between the tree mixin and NPUModelRunner (see the outer class)."""

    def _prepare_inputs(self, *args, **kwargs):
        logits_indices, spec_md, *extra = super()._prepare_inputs(*args, **kwargs)
        self._npu_prepare_extra = tuple(extra)
        return logits_indices, spec_md


class _NPUStartupChecks:
    """Between the tree mixin and NPUModelRunner: the buffers are reserved inside
    the profiling run, and the KV-cache checks run right after NPUModelRunner's
    own ``initialize_kv_cache``, before the mixin checks each group's backend and
    calibrates."""

    def profile_run(self):
        # Inside vLLM's memory profiling: the buffers count before the KV cache is sized.
        held = reserve_for_profiling(_attention_layers(self.vllm_config), self.device)
        logger.info("eagle3_tree: Ascend tree attention buffers hold %.1f MiB "
                    "(reserved before the KV cache is sized)", held / 2**20)
        return super().profile_run()

    def initialize_kv_cache(self, *args, **kwargs):
        super().initialize_kv_cache(*args, **kwargs)
        # On vllm-ascend there must be groups (the mixin then checks their backends),
        # and every layer must still hold the tree impl (quantisation may swap it).
        checks.check_attention_groups(getattr(self, "attn_groups", None))
        checks.check_layer_impls(_attention_layers(self.vllm_config), TreeAscendAttentionImpl)


def tree_npu_runner_class(base: type) -> type:
    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    return type("TreeNPUModelRunner", (_NPURunnerKVLayout, _NPUPrepareInputsOuter,
                                       TreeRunnerMixin, _NPUPrepareInputsInner,
                                       _NPUStartupChecks, base), {})
