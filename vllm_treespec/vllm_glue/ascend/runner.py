"""The tree runner on vllm-ascend: ``NPUModelRunner`` + the device-agnostic
``TreeRunnerMixin``, joined by small MRO shims.

Owns :func:`tree_npu_runner_class` (the worker swaps the class it returns in for
``init_device`` only, as the CPU worker does) and the shims that adapt the KV
layout, the drafter class and ``_prepare_inputs``'s return value. Imports
:mod:`.backend` (KV layout) and :mod:`.proposer`; the mixin lazily.
"""

from __future__ import annotations

from vllm_treespec.vllm_glue.ascend.backend import TreeAscendAttentionBackend, kv_pair
from vllm_treespec.vllm_glue.ascend.proposer import tree_ascend_proposer_class


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


def tree_npu_runner_class(base: type) -> type:
    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    return type("TreeNPUModelRunner", (_NPURunnerKVLayout, _NPUPrepareInputsOuter,
                                       TreeRunnerMixin, _NPUPrepareInputsInner, base), {})
