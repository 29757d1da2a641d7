"""A drafter checkpoint fits its target, checked before any process loads weights.

Without these checks a wrong head fails mid-load with a shape error, or (worse)
loads and drafts from the wrong layers or into the wrong tokens, and the only
sign is low acceptance. One function, ``check_drafter_config``, checks a head's
config against the target's, however the head is named:

* a local directory: its config.json, read by ``check_drafter`` when the
  speculative config is made, then its weight files (``fc``, ``d2t``,
  ``mask_hidden``; safetensors or ``.bin``);
* a hub id: the draft ``hf_config`` vLLM resolves while it builds the engine
  config (``spec_config.check_resolved_drafter``, which checks a local head's
  again), before any process loads the weights; its vocabulary map is checked
  once loaded (``proposer``, ``check_token_map``).

Configs are read in the form vLLM reads them: a speculators-format config.json
is converted by vLLM's own converter first, so a local and a hub head of that
format are read alike.

Pure checks over plain values (config dicts, shapes, tensors).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_treespec.config import TreeSpecConfigError

NOT_A_PARALLEL_HEAD = ("no 'mask_hidden' tensor in its weights: not a parallel-drafting head "
                       "(\"draft\": \"parallel\" needs one trained with `vllm-treespec "
                       "train-drafter --parallel K`)")

# vLLM's target runner gathers this many auxiliary hidden states when the head
# names no layers (the model's default EAGLE-3 layers), and its drafters size fc
# for this many when they find no count.
DEFAULT_AUX_LAYERS = 3
# Draft classes that count the top-level eagle_aux_hidden_state_layer_ids when
# they size fc (vLLM's qwen3_eagle3); the others (llama_eagle3, deepseek_eagle3)
# read only num_aux_hidden_states or eagle_config's list. A raw original-layout
# Qwen3 head is named Qwen3ForCausalLM (vLLM renames it Eagle3Qwen3ForCausalLM).
_COUNTS_TOP_LEVEL_IDS = {"Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM", "Qwen3ForCausalLM"}
# Trainer state that vLLM skips among .bin files (weight_utils'
# filter_files_not_needed_for_inference): not weights, and not weights_only-loadable.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.bin"}


def bad_drafter(where: Path | str, what: str) -> TreeSpecConfigError:
    return TreeSpecConfigError(f"eagle3_tree: drafter {str(where)!r}: {what}")


@dataclass(frozen=True)
class HeadShape:
    """What a head's weights must look like to serve its target."""
    target_hidden: int  # the size of each target hidden state fc takes
    aux_layers: int     # how many the target sends (fc takes aux_layers x target_hidden)
    draft_vocab: int    # lm_head rows, and d2t entries where there is a map
    vocab: int          # the target's vocabulary

    @property
    def fc_inputs(self) -> int:
        return self.aux_layers * self.target_hidden


def as_vllm_reads_it(where: Path | str, config: dict) -> dict:
    """A drafter config in the form of vLLM's draft ``hf_config``. A speculators
    config.json keeps the layer's fields under ``transformer_layer_config`` and the
    algorithm's at the top (``mask_token_id`` for ``pard_token``); vLLM converts it
    with ``SpeculatorsConfig``, and so do we, rather than keep a second copy."""
    if "speculators_model_type" not in config:
        return config
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    try:  # the converter fills transformer_layer_config in place
        return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))
    except (KeyError, ValueError, TypeError) as e:
        raise bad_drafter(where, f"speculators config.json that vLLM cannot convert "
                                 f"(speculators_model_type "
                                 f"{config['speculators_model_type']!r}): {e!r}") from None


def _aux_layer_counts(config: dict) -> tuple[Any, int, int, str]:
    """(layer ids, hidden states the target sends, hidden states fc is built for,
    how that count was taken) as vLLM 0.27.1 / 0.32.0 count them: the runner
    takes the top-level ids, else eagle_config's; the drafter class counts its own
    way (``_COUNTS_TOP_LEVEL_IDS``)."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or nested
    # The target's layers each append their state once, however often an id repeats.
    sends = len(set(layer_ids)) if isinstance(layer_ids, (list, tuple)) and layer_ids \
        else DEFAULT_AUX_LAYERS
    if (config.get("architectures") or [None])[0] in _COUNTS_TOP_LEVEL_IDS:
        keys, counted = ["num_aux_layers", "num_aux_hidden_states"], layer_ids
        how = "num_aux_layers, else num_aux_hidden_states, else the ids"
    else:
        keys, counted = ["num_aux_hidden_states"], nested
        how = "num_aux_hidden_states, else the ids under eagle_config"
    built = next((config[k] for k in keys if config.get(k) is not None), None)
    if built is None:
        built = len(counted) if isinstance(counted, (list, tuple)) and counted \
            else DEFAULT_AUX_LAYERS
    return layer_ids, sends, built, f"it counts {how}, else {DEFAULT_AUX_LAYERS}"


def check_drafter_config(where: Path | str, config: dict, target: Any,
                         parallel_depth: int | None = None) -> HeadShape:
    """A drafter's config (its config.json, or the ``hf_config.to_dict()`` vLLM
    resolved for a hub head) fits ``target`` (the target's HF text config); the
    shape its weights must have is returned. With ``parallel_depth``, the head
    must also be a parallel-drafting one (``check_parallel_head``)."""
    config = as_vllm_reads_it(where, config)
    key = "target_hidden_size" if config.get("target_hidden_size") else "hidden_size"
    hidden = config.get(key)
    if hidden != target.hidden_size:
        raise bad_drafter(where, f"trained on hidden states of size {hidden} (config.json "
                                 f"{key} {hidden}); allowed: the target's hidden_size "
                                 f"{target.hidden_size}")
    layer_ids, sends, built, how = _aux_layer_counts(config)
    layers = target.num_hidden_layers
    if layer_ids is not None and not (isinstance(layer_ids, (list, tuple)) and all(
            isinstance(i, int) and 0 <= i < layers for i in layer_ids)):
        raise bad_drafter(where, f"eagle_aux_hidden_state_layer_ids {layer_ids} in "
                                 f"config.json; the target has layers 0..{layers - 1}")
    if sends != built:
        # vLLM would fail mid-load with a shape error (fc's weight against its size)
        raise bad_drafter(where, f"eagle_aux_hidden_state_layer_ids {layer_ids} in "
                                 f"config.json: the target sends {sends} hidden states, but "
                                 f"vLLM's {(config.get('architectures') or ['?'])[0]} sizes "
                                 f"fc for {built} ({how}); allowed: "
                                 f"num_aux_hidden_states {sends} (in transformer_layer_config "
                                 f"for the speculators format), or the ids under eagle_config")
    vocab = config.get("vocab_size")
    if vocab != target.vocab_size:
        raise bad_drafter(where, f"vocab_size {vocab} in config.json; "
                                 f"the target's vocab_size is {target.vocab_size}")
    if parallel_depth is not None:
        check_parallel_head(where, config, parallel_depth)
    # vLLM's default where the head has no reduced vocabulary
    draft_vocab = config.get("draft_vocab_size") or vocab
    return HeadShape(target_hidden=hidden, aux_layers=sends, draft_vocab=draft_vocab,
                     vocab=target.vocab_size)


def check_drafter(model: str, target: Any, parallel_depth: int | None = None) -> None:
    """The drafter named by speculative-config ``model`` fits ``target`` (the
    target's HF text config), from its files. A name that is not a local path is
    a hub id: its config is checked once vLLM has resolved it
    (``check_drafter_config``, called from ``spec_config``). With
    ``parallel_depth`` (the tree depth of ``"draft": "parallel"``), the head must
    also have been trained for parallel drafting, with at least that many slots."""
    path = Path(model).expanduser()
    if not path.is_dir():
        if path.exists() or path.is_absolute() or model.startswith((".", "~")):
            raise TreeSpecConfigError(
                f"eagle3_tree: speculative-config key 'model' has invalid value {model!r}; "
                f"allowed: a directory holding an EAGLE-3 drafter (config.json and "
                f"*.safetensors or *.bin), or a hub model id")
        return
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise bad_drafter(path / "config.json", f"unreadable ({e})") from None
    head = check_drafter_config(path, config, target, parallel_depth)
    files = _weight_files(path)
    if not files:
        raise bad_drafter(path, "no weights (*.safetensors or *.bin) in the directory")
    found = [_read_head_tensors(file) for file in files]
    for file, (fc, d2t, mask) in zip(files, found):
        check_head_tensors(file, head, fc, d2t, mask)
    if head.draft_vocab != head.vocab and not any(d2t is not None for _, d2t, _ in found):
        raise bad_drafter(path, missing_token_map(head))
    if parallel_depth is not None and not any(mask is not None for *_, mask in found):
        raise bad_drafter(path, NOT_A_PARALLEL_HEAD)


def _weight_files(path: Path) -> list[Path]:
    """A head directory's weight files as vLLM loads them: the *.safetensors, and
    the *.bin only where there are none."""
    return sorted(path.glob("*.safetensors")) or sorted(
        f for f in path.glob("*.bin") if f.name not in _NOT_WEIGHTS)


def missing_token_map(head: HeadShape) -> str:
    return (f"draft_vocab_size {head.draft_vocab} in config.json, the target's vocab_size "
            f"{head.vocab}, and no 'd2t' tensor in its weights: vLLM would map draft token i "
            f"to target token i (an all-zero map), drafting from the first "
            f"{head.draft_vocab} target tokens only; allowed: a d2t map (draft token i -> "
            f"target token i + d2t[i]) in the weights, or draft_vocab_size "
            f"{head.vocab} (the full vocabulary, no map)")


def check_parallel_head(where: Path | str, config: dict, depth: int) -> None:
    """A drafter's config (config.json, or vLLM's resolved ``hf_config``, as a
    dict) trained for parallel drafting with at least ``depth`` slots. The
    speculators format names the token ``mask_token_id``; vLLM's converter (and
    ``as_vllm_reads_it``) maps it to ``pard_token``, what the proposer reads."""
    config = as_vllm_reads_it(where, config)
    pard = config.get("pard_token")
    if isinstance(pard, bool) or not isinstance(pard, int):
        raise bad_drafter(where, "no integer 'pard_token' (speculators format: "
                                 "'mask_token_id') in config.json: not trained for parallel "
                                 "drafting; use \"draft\": \"sequential\" or a head trained "
                                 "with `vllm-treespec train-drafter --parallel K`")
    slots = config.get("parallel_drafting_slots")
    if isinstance(slots, int) and not isinstance(slots, bool) and depth > slots:
        raise TreeSpecConfigError(
            f"eagle3_tree: speculative-config key 'depth' has invalid value {depth}; allowed: "
            f"an integer in [1, {slots}] (the drafter {str(where)!r} was trained for "
            f"{slots} parallel-drafting slots)")


def _read_head_tensors(file: Path) -> tuple[Any, Any, Any]:
    """(fc.weight's shape, the d2t tensor, mask_hidden's shape) of one weight file,
    each None where absent. Safetensors are read lazily; a ``.bin`` (the original
    EAGLE-3 releases ship pytorch_model.bin) is memory-mapped where its format
    allows, with weights_only (a checkpoint must not run code on load)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(file, "pt") as weights:
                keys = set(weights.keys())
                return (weights.get_slice("fc.weight").get_shape() if "fc.weight" in keys
                        else None,
                        weights.get_tensor("d2t") if "d2t" in keys else None,
                        weights.get_slice("mask_hidden").get_shape()
                        if "mask_hidden" in keys else None)
        except Exception as e:  # safetensors raises its own error types
            raise bad_drafter(file, f"not a readable safetensors file ({e}); copy or "
                                    f"export the drafter again") from None
    import torch

    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a pre-zipfile (legacy) .bin cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many error types for damaged files
        raise bad_drafter(file, f"not a readable PyTorch state dict ({e}); copy or "
                                f"export the drafter again") from None
    if not isinstance(state, dict):
        raise bad_drafter(file, f"holds a {type(state).__name__}, not a state dict")
    fc, d2t, mask = (state.get(k) for k in ("fc.weight", "d2t", "mask_hidden"))
    return (None if fc is None else list(fc.shape), d2t,
            None if mask is None else list(mask.shape))


def check_head_tensors(where: Path | str, head: HeadShape, fc: Any, d2t: Any,
                       mask: Any) -> None:
    """One weight file's ``fc.weight`` shape, ``d2t`` map and ``mask_hidden``
    shape (each None where the file has none) fit ``head``: fc takes the target's
    auxiliary hidden states (target hidden size x their number, as vLLM sizes fc),
    d2t has one entry per draft token and maps them injectively into the target
    vocabulary, and a parallel-drafting state is sized like fc's input."""
    import torch

    if fc is not None and fc[-1] != head.fc_inputs:
        raise bad_drafter(where, f"fc.weight has shape {list(fc)}; an EAGLE-3 drafter of "
                                 f"this target needs {head.fc_inputs} inputs "
                                 f"({head.aux_layers} auxiliary layers x target hidden size "
                                 f"{head.target_hidden})")
    if d2t is not None:
        if d2t.numel() != head.draft_vocab:
            raise bad_drafter(where, f"d2t has {d2t.numel()} entries; allowed: "
                                     f"{head.draft_vocab}, one per draft token "
                                     f"(config.json draft_vocab_size)")
        check_token_map(torch.arange(d2t.numel()) + d2t.flatten(), head.vocab, where)
    if mask is not None and math.prod(mask) != head.fc_inputs:
        raise bad_drafter(where, f"mask_hidden has shape {list(mask)}; a parallel-drafting "
                                 f"head of this target needs {head.fc_inputs} values")


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


def describe_head(where: Path | str, config: dict, target: Any) -> list[str]:
    """What a head that passed ``check_drafter_config`` is, as lines for a person
    (``vllm-treespec check``): its layout, the target layers it reads and its
    vocabulary map (read from the weights of a local directory)."""
    layout = ("speculators format (speculators_model_type "
              f"{config['speculators_model_type']!r}, converted by vLLM)"
              if "speculators_model_type" in config else "original EAGLE-3 layout")
    read = as_vllm_reads_it(where, config)
    head = check_drafter_config(where, config, target)
    layer_ids, sends, _, _ = _aux_layer_counts(read)
    layers = (f"target layers {list(layer_ids)}" if layer_ids
              else f"the target model's default EAGLE-3 layers ({sends})")
    lines = [f"head: {layout}, {(read.get('architectures') or ['?'])[0]}",
             f"reads: {layers} of hidden size {head.target_hidden}"]
    path = Path(where)
    files = _weight_files(path) if path.is_dir() else []
    has_map = any(_read_head_tensors(f)[1] is not None for f in files) if files else None
    if head.draft_vocab == head.vocab and not has_map:
        vocab = f"the full vocabulary ({head.vocab} tokens), no map"
    elif has_map is None:
        vocab = (f"{head.draft_vocab} draft tokens of {head.vocab}; its d2t map is checked "
                 f"when the weights load (a hub head)")
    else:
        vocab = f"{head.draft_vocab} draft tokens of {head.vocab}, mapped by d2t"
    return lines + [f"vocabulary: {vocab}"]
