"""Reading the target's weights for the drafter: its tied embedding, output head
and final norm (the drafter shares the embedding and starts from the head), one
decoder layer, and the initialisation that copies them into a fresh drafter."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from vllm_treespec.train.model import Eagle3Drafter


def load_target_head(target_dir: str | Path):
    """(config, tied embedding [V, d], final norm weight [d]) of a HF Llama target."""
    from safetensors import safe_open
    from transformers import AutoConfig

    target_dir = Path(target_dir)
    cfg = AutoConfig.from_pretrained(target_dir)
    files = sorted(target_dir.glob("*.safetensors"))
    want = {"model.embed_tokens.weight": None, "model.norm.weight": None, "lm_head.weight": None}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key in want:
                    want[key] = st.get_tensor(key).float()
    embed = want["model.embed_tokens.weight"]
    head = want["lm_head.weight"] if want["lm_head.weight"] is not None else embed
    return cfg, embed, head, want["model.norm.weight"]


def load_target_layer(target_dir: str | Path, layer: int) -> dict[str, torch.Tensor]:
    """Weights of one decoder layer of the target (names relative to the layer)."""
    from safetensors import safe_open

    prefix = f"model.layers.{layer}."
    out = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = st.get_tensor(key).float()
    return out


def init_from_target(model: "Eagle3Drafter", target_dir: str | Path, mode: str = "target") -> None:
    """Initialise from the target.

    Always: ``lm_head`` = the target's output head restricted to the draft
    vocabulary and ``norm`` = its final norm, so step 1 starts out reading the
    drafter's output the way the target reads its own last state.
    ``mode="target"`` also copies the target's last decoder layer into the
    midlayer (the hidden-state half of q/k/v; the embedding half starts at
    zero) and sets ``fc`` to pass the deepest auxiliary state through: at the
    start the drafter is then close to "one more target layer on top of the
    deepest captured state", which predicts sensible tokens from step one.
    """
    _, embed, head, norm_w = load_target_head(target_dir)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head[model.draft_ids.cpu()])
        if norm_w is not None:
            model.norm.weight.copy_(norm_w)
        if mode != "target":
            return
        from transformers import AutoConfig

        n_layers = AutoConfig.from_pretrained(target_dir).num_hidden_layers
        w = load_target_layer(target_dir, n_layers - 1)
        d = model.cfg.hidden_size
        layer = model.midlayer
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(attn, name)
            lin.weight.zero_()
            lin.weight[:, d:] = w[f"self_attn.{name}.weight"]
            # small random embedding half so the token input is not dead at start
            nn.init.normal_(lin.weight[:, :d], std=0.02)
        attn.o_proj.weight.copy_(w["self_attn.o_proj.weight"])
        layer.hidden_norm.weight.copy_(w["input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(w["post_attention_layernorm.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(w[f"mlp.{name}.weight"])
        n_aux = len(model.cfg.aux_layers)
        model.fc.weight.zero_()
        model.fc.weight[:, (n_aux - 1) * d :] = torch.eye(d)
        nn.init.normal_(model.fc.weight[:, : (n_aux - 1) * d], std=0.01)
