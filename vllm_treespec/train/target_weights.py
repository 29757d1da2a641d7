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
    """(config, embedding [V, d], output head [V, d], final norm weight [d]) of a HF
    target (the head is the embedding where they are tied)."""
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
    midlayer (the hidden-state half of q/k/v, with their biases where the
    target has them; the embedding half starts small and random) and sets
    ``fc`` to pass the deepest auxiliary state through: at the start the drafter is then close to "one more target layer on top of the
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
            lin.weight[:, d:] = _fold_head_norm(w, name, attn.head_dim)
            # small random embedding half so the token input is not dead at start
            nn.init.normal_(lin.weight[:, :d], std=0.02)
            if lin.bias is not None:  # Qwen2's q/k/v biases
                lin.bias.copy_(w[f"self_attn.{name}.bias"])
        attn.o_proj.weight.copy_(w["self_attn.o_proj.weight"])
        if attn.o_proj.bias is not None:  # Qwen2's o_proj has none: it starts at zero
            attn.o_proj.bias.copy_(w.get("self_attn.o_proj.bias", torch.zeros(d)))
        layer.hidden_norm.weight.copy_(w["input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(w["post_attention_layernorm.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(w[f"mlp.{name}.weight"])
        n_aux = len(model.cfg.aux_layers)
        model.fc.weight.zero_()
        model.fc.weight[:, (n_aux - 1) * d :] = torch.eye(d)
        nn.init.normal_(model.fc.weight[:, : (n_aux - 1) * d], std=0.01)


def _fold_head_norm(w: dict[str, torch.Tensor], name: str, head_dim: int) -> torch.Tensor:
    """The target's ``name`` projection, with a Qwen3 per-head q/k RMSNorm's weight
    folded into its rows. The Llama head has no such norm: what the fold keeps is
    the direction of each head's query and key (the norm's elementwise weight);
    what it cannot keep is the norm's division by the head's RMS, so the head
    starts with the target's attention pattern at another temperature."""
    weight = w[f"self_attn.{name}.weight"]
    norm = w.get(f"self_attn.{name[0]}_norm.weight")
    if norm is None:
        return weight
    assert norm.numel() == head_dim, (name, norm.shape, head_dim)
    return weight * norm.repeat(weight.shape[0] // head_dim).unsqueeze(1)
