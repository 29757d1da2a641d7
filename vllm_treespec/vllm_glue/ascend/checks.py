"""Startup refusals of Ascend setups the tree backend would serve wrongly.

Each check names the setting, the value found and what is allowed, and says how
to fix it. Pure functions over vLLM's config objects and plain values: nothing
here imports torch_npu or vllm_ascend, so the checks run (and are tested) on any
machine. The worker (:mod:`.worker`), the runner shims (:mod:`.runner`) and the
attention impl (:mod:`.backend`) call them with what they hold at that point.

Why each one matters:

* block size: the persistent mask, the plans and the block-table cut assume
  vllm-ascend's ``ASCEND_BLOCK_SIZE``-token blocks; another size would index the
  wrong KV slots;
* quantised KV (C8, FA quant, ``kv_cache_dtype``): vllm-ascend's C8 path swaps
  each layer's impl class for its own (``layer.impl.__class__ = ...``), which
  drops the tree rows and verifies trees causally;
* MLA: vllm-ascend serves MLA models with another backend, which has no tree path;
* CANN: the fused calls were mapped on one CANN release (with vllm-ascend and
  torch_npu, :func:`~vllm_treespec.vllm_glue.support.check_ascend_pairing`);
* attention groups and impl classes: if the tree backend did not reach every
  layer, tree rows would get causal attention without any error;
* layer arguments (ALiBi, soft-capping, sliding windows, sinks): features the
  tree calls do not apply;
* a step that does not fit the persistent buffers sized at startup
  (:func:`check_step_fits`, each step): fails with what to change.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

from vllm_treespec.attention.ascend.constants import ASCEND_BLOCK_SIZE
from vllm_treespec.attention.ascend.settings import EXEC_MODE_ENV
from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import versions
from vllm_treespec.vllm_glue import support
from vllm_treespec.vllm_glue.support import ALLOW_UNTESTED_ENV

PREFIX = "eagle3_tree on Ascend"


def check_block_size(block_size: int | None) -> None:
    if block_size != ASCEND_BLOCK_SIZE:
        raise TreeSpecConfigError(
            f"{PREFIX}: engine argument 'block_size' has invalid value {block_size}; "
            f"allowed: {ASCEND_BLOCK_SIZE} (the only KV block size of vllm-ascend's "
            f"attention kernels and of the tree masks). Drop --block-size or pass "
            f"--block-size {ASCEND_BLOCK_SIZE}")


def check_quantised_kv(quant_config: Any, cache_dtype: str | None) -> None:
    """C8 / FA-quantised KV and any ``kv_cache_dtype`` other than 'auto'."""
    for flag, what in (("enable_c8_quant", "C8 int8 KV cache (kv_cache_type 'C8')"),
                       ("enable_fa_quant", "quantised attention (fa_quant_type)")):
        if quant_config is not None and getattr(quant_config, flag, False) is True:
            raise TreeSpecConfigError(
                f"{PREFIX} does not support {what}: the model's quantisation config sets "
                f"{flag}=True, and vllm-ascend then replaces each attention layer's impl "
                f"with its quantised one, which has no tree path. Serve a checkpoint "
                f"without KV quantisation, or use another speculative method")
    if cache_dtype not in (None, "auto"):
        raise TreeSpecConfigError(
            f"{PREFIX}: engine argument 'kv_cache_dtype' has invalid value {cache_dtype!r}; "
            f"allowed: 'auto' (the tree calls read the cache in the model's dtype). "
            f"Drop --kv-cache-dtype")


def check_not_mla(model_config: Any) -> None:
    if getattr(model_config, "use_mla", False):
        arch = getattr(getattr(model_config, "hf_config", None), "model_type", "?")
        raise TreeSpecConfigError(
            f"{PREFIX} does not support MLA models yet (model_type {arch!r}): vllm-ascend "
            f"serves them with its MLA backend, which has no tree path. Serve a GQA/MHA "
            f"model, or use another speculative method for this one")


def _release(version: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:3])


def check_cann(vllm_release: str, cann: str | None) -> None:
    """``torch.version.cann`` (set by torch_npu) matches the pairing's CANN."""
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    pairing = versions.ASCEND_PAIRINGS.get(vllm_release)
    if pairing is None:  # refused by check_ascend_pairing already, with the full list
        return
    if _release(cann) != _release(pairing.cann):
        raise TreeSpecConfigError(
            f"{PREFIX}: found CANN {cann!r} (torch.version.cann); supported with vLLM "
            f"{vllm_release}: CANN {pairing.cann}. Install CANN {pairing.cann} "
            f"(docs/ascend.md), or set {ALLOW_UNTESTED_ENV}=1 to try anyway")


def check_engine(vllm_config: Any) -> None:
    """The config-level checks above, on the engine's ``VllmConfig``."""
    check_not_mla(vllm_config.model_config)
    cache = vllm_config.cache_config
    check_block_size(getattr(cache, "block_size", None))
    check_quantised_kv(getattr(vllm_config, "quant_config", None),
                       getattr(cache, "cache_dtype", None))


def check_attention_groups(attn_groups: Any) -> None:
    """vllm-ascend's runner keeps its layers' backends in ``attn_groups``; none
    means the tree-backend check had nothing to look at."""
    if not any(groups for groups in (attn_groups or ())):
        raise TreeSpecConfigError(
            f"{PREFIX}: the runner has no attention groups after initialize_kv_cache, so "
            f"it cannot check that every layer runs the tree backend (vllm-ascend's "
            f"NPUModelRunner.attn_groups moved?). Install the vllm-ascend commit of "
            f"docs/ascend.md's pairing table")


def check_layer_impls(layers: dict[str, Any], impl_cls: type) -> None:
    """Every attention layer (``static_forward_context``) still has the tree impl
    after the weights were loaded (C8 swaps the class while it creates weights)."""
    other = sorted({f"{name}: {type(layer.impl).__name__}" for name, layer in layers.items()
                    if hasattr(layer, "impl") and hasattr(layer, "attn_backend")
                    and not isinstance(layer.impl, impl_cls)})
    if other:
        raise TreeSpecConfigError(
            f"{PREFIX}: attention layers run {other[:4]}{' ...' if len(other) > 4 else ''}, "
            f"not {impl_cls.__name__}; they would verify trees causally (a quantisation "
            f"method replaced the impl class?). Serve the model without KV quantisation")


def check_step_fits(plan: TreeAttentionPlan, buffers: TreeAttentionBuffers,
                    vllm_config) -> None:
    """A step's plan fits the persistent buffers sized at startup."""
    sc = vllm_config.scheduler_config
    if plan.batch_size > buffers.max_reqs:
        raise RuntimeError(
            f"eagle3_tree: a verify step of {plan.batch_size} trees exceeds the Ascend tree "
            f"buffers, sized for max_num_seqs + 2 = {buffers.max_reqs} (max_num_seqs "
            f"{sc.max_num_seqs}); the scheduler should never batch more. Fix: report it "
            f"with the server log; until then serve with {EXEC_MODE_ENV}=reference "
            f"(no persistent buffers)")
    if plan.tree_size != buffers.T:
        raise RuntimeError(
            f"eagle3_tree: a verify step with trees of {plan.tree_size} tokens; the Ascend "
            f"tree buffers hold 1 + num_speculative_tokens = {buffers.T} per request (the "
            f"scheduler never schedules more drafts). Fix: report it with the server log; "
            f"until then serve with {EXEC_MODE_ENV}=reference (no persistent buffers)")
    longest = max(plan.kv_lens, default=0)
    if longest > buffers.full_mask_columns:
        raise RuntimeError(
            f"eagle3_tree: a request holds {longest} KV tokens; the Ascend tree buffers "
            f"cover max_model_len = {vllm_config.model_config.max_model_len} "
            f"({buffers.max_blocks} blocks of {buffers.block_size}). Fix: raise "
            f"--max-model-len to at least {longest}")


def check_layer_arguments(init, args: tuple, kwargs: dict) -> None:
    """The attention features the tree calls ignore, from the arguments a layer
    gives vllm-ascend's impl ``init`` (its ``__init__``; ``logits_soft_cap`` is not
    kept on the impl, so the arguments are read, not the impl's attributes)."""
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    bound.apply_defaults()
    a = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    support.check_attention_layer(
        sliding_window=a.get("sliding_window"), alibi_slopes=a.get("alibi_slopes"),
        logits_soft_cap=a.get("logits_soft_cap"), sinks=a.get("sinks"),
        kv_cache_dtype=a.get("kv_cache_dtype") or "auto")
