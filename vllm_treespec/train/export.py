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
                manifest_extra: dict | None = None) -> Path:
    """Copy the best evaluated checkpoint (by acceptance proxy) to ``out`` with a MANIFEST.json."""
    ck = torch.load(work / "ckpt" / "last.pt", map_location="cpu", weights_only=False)
    best = ck["state"]["best"]
    if best is None:
        raise RuntimeError("no evaluated checkpoint yet")
    src = Path(best["path"])
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, out / name)
    if dtype != "bfloat16":
        from .target_weights import load_target_head

        _, embed, _, _ = load_target_head(ck["config"]["target"])
        model = Eagle3Drafter.load_checkpoint(out, embed_weight=embed)
        model.save_checkpoint(out, dtype=getattr(torch, dtype))
    st = ck["state"]
    manifest = {
        "format": "vLLM LlamaForCausalLMEagle3 (speculative method 'eagle3'"
                  + (", parallel_drafting)" if ck["config"].get("parallel") else ")"),
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
