"""Exporting a trained head: the best evaluated checkpoint of a run, as the
checkpoint stock vLLM loads, with its MANIFEST.json (training configuration,
held-out figures, file hashes)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .model import Eagle3Drafter


def export_best(work: Path, out: Path, dtype: str = "bfloat16", log: Callable[[str], None] = print,
                manifest_extra: dict | None = None, layout: str = "eagle3") -> Path:
    """Copy the best evaluated checkpoint (by acceptance proxy) to ``out`` with a
    MANIFEST.json, in ``layout``: "eagle3" (the original EAGLE-3 layout, vLLM's
    ``LlamaForCausalLMEagle3``) or "speculators" (``write_speculators_layout``)."""
    ck = torch.load(work / "ckpt" / "last.pt", map_location="cpu", weights_only=False)
    best = ck["state"]["best"]
    if best is None:
        raise RuntimeError("no evaluated checkpoint yet")
    src = Path(best["path"])
    original = out if layout == "eagle3" else work / "export-eagle3"
    original.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, original / name)
    if dtype != "bfloat16":
        from .target_weights import load_target_head

        _, embed, _, _ = load_target_head(ck["config"]["target"])
        model = Eagle3Drafter.load_checkpoint(original, embed_weight=embed)
        model.save_checkpoint(original, dtype=getattr(torch, dtype))
    parallel = ck["config"].get("parallel")
    if layout == "speculators":
        if parallel:
            raise ValueError("--layout speculators: parallel-drafting heads export in the "
                             "eagle3 layout only")
        write_speculators_layout(original, out, ck["config"]["target"])
    st = ck["state"]
    manifest = {
        "format": ("speculators Eagle3DraftModel (vLLM speculative method 'eagle3')"
                   if layout == "speculators" else
                   "vLLM LlamaForCausalLMEagle3 (speculative method 'eagle3'"
                   + (", parallel_drafting)" if parallel else ")")),
        "weights_dtype": dtype,
        "training": {
            "config": ck["config"],
            "steps": st["step"],
            "label_positions": st["positions"],
            "train_hours": round(st["train_seconds"] / 3600, 2),
            "selected_step": best["step"],
            "heldout_eval": {k: best[k] for k in ("top1_per_step", "accept_len_proxy", "eval_positions")},
        },
    }
    manifest.update(manifest_extra or {})
    write_manifest(out, manifest)
    log(f"[export] {src} -> {out}")
    return out


def write_manifest(out: Path, manifest: dict) -> dict:
    """MANIFEST.json: ``files`` holds the SHA-256 of every payload file (what
    ``vllm-treespec assets`` verifies); other keys are kept from an existing
    manifest unless ``manifest`` replaces them."""
    from ..assets import sha256_file

    path = out / "MANIFEST.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    merged = {**old, **manifest}
    merged["files"] = {name: sha256_file(out / name) for name in ("config.json", "model.safetensors")}
    merged["size_bytes"] = sum((out / n).stat().st_size for n in merged["files"])
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


# The decoder layer's keys a speculators config carries in transformer_layer_config.
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps",
               "max_position_embeddings", "hidden_act", "tie_word_embeddings", "attention_bias",
               "mlp_bias", "rope_parameters")


def write_speculators_layout(head: str | Path, out: str | Path, verifier: str,
                             speculative_tokens: int = 3,
                             norm_before_residual: bool = False) -> Path:
    """Write the EAGLE-3 head in directory ``head`` (original layout: config.json and
    model.safetensors, as ``train-drafter`` exports it) to ``out`` in the
    ``speculators`` format (speculators 0.9.0's ``Eagle3DraftModel``, what vLLM's
    speculators reader and the published ``*-speculator.eagle3`` heads use): the
    decoder layer's sizes in ``transformer_layer_config``, the verifier named,
    weights under ``layers.0.*`` instead of ``midlayer.*``. ``norm_before_residual``
    False computes what the original layout computes (vLLM's
    ``LlamaForCausalLMEagle3`` reads no such key and defaults to False); vLLM's
    speculators reader defaults an absent key to True, so it is always written."""
    from safetensors.torch import load_file, save_file

    head, out = Path(head), Path(out)
    cfg = json.loads((head / "config.json").read_text())
    verifier_cfg = json.loads((Path(verifier) / "config.json").read_text()) \
        if (Path(verifier) / "config.json").exists() else {}
    layer = {key: cfg[key] for key in _LAYER_KEYS if key in cfg}
    layer["model_type"] = "llama"
    layer.setdefault("rope_parameters", {"rope_type": "default",
                                         "rope_theta": cfg.get("rope_theta", 10000.0)})
    eagle = cfg.get("eagle_config") or {}
    config = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "accept_tolerance": 0.0,
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(verifier),
                         "architectures": verifier_cfg.get("architectures", [])}},
        "draft_vocab_size": cfg["draft_vocab_size"],
        "norm_before_residual": norm_before_residual, "norm_before_fc": False,
        "fc_norm": False, "norm_output": False,
        "target_hidden_size": (cfg["target_hidden_size"]
                               if cfg.get("target_hidden_size", cfg["hidden_size"])
                               != cfg["hidden_size"] else None),
        "eagle_aux_hidden_state_layer_ids": eagle.get(
            "eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids")),
        "embed_requires_grad": False, "tie_word_embeddings": False,
        "dtype": cfg.get("torch_dtype", "bfloat16"),
        "transformer_layer_config": layer,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(str(head / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0.", 1): v.contiguous() for k, v in weights.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
