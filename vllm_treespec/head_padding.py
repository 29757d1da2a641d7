"""Attention heads padded so that a tensor-parallel size divides them, computing
exactly the same function.

SmolLM2-135M has 9 query / 3 KV heads (groups of 3), which no tensor-parallel
size above 1 divides. Padding each attention layer to 12 query / 4 KV heads
(group size 3 kept) makes TP = 2 and 4 possible: the new KV head's k and v rows
are zero, and so are the o_proj columns of the three new query heads (which read
only the new KV head). Whatever those heads attend to, their output is multiplied
by zero columns: the layer's output is the original one, exactly. The EAGLE-3 head
pads the same way (``midlayer.self_attn``; its q/k/v input is 2 x hidden).

Pure tensor functions over a state dict and a config dict; ``assets`` caches the
padded SmolLM2 pair (``vllm-treespec assets``).
"""

from __future__ import annotations

import re

import torch

_ATTN = re.compile(r"^(?P<layer>.*self_attn)\.(?P<proj>[qkvo])_proj\.weight$")


def padded_heads(num_heads: int, num_kv_heads: int, multiple: int) -> tuple[int, int]:
    """The smallest (query, kv) head counts >= the given ones that ``multiple``
    divides, with the same group size (query heads per KV head)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    kv = -(-num_kv_heads // multiple) * multiple
    while (kv * group) % multiple:
        kv += multiple
    return kv * group, kv


def pad_attention(state: dict[str, torch.Tensor], config: dict, num_heads: int,
                  num_kv_heads: int) -> tuple[dict[str, torch.Tensor], dict]:
    """``state`` and ``config`` with every ``*.self_attn.{q,k,v,o}_proj`` padded to
    ``num_heads`` query / ``num_kv_heads`` KV heads (zero rows and columns; see the
    module docstring). ``config`` needs ``num_attention_heads``,
    ``num_key_value_heads`` and ``head_dim`` (or ``hidden_size``)."""
    old_q, old_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // old_q
    if num_heads // num_kv_heads != old_q // old_kv or num_heads < old_q:
        raise ValueError(f"padding {old_q}/{old_kv} heads to {num_heads}/{num_kv_heads} "
                         f"changes the group size or drops heads")
    out = dict(state)
    found = set()
    for name, weight in state.items():
        match = _ATTN.match(name)
        if not match:
            continue
        proj = match["proj"]
        found.add(proj)
        if proj == "o":  # [hidden, heads * D]: zero columns for the new query heads
            extra = weight.new_zeros(weight.shape[0], (num_heads - old_q) * head_dim)
            out[name] = torch.cat([weight, extra], dim=1)
        else:  # [heads * D, in]: zero rows for the new heads
            new = (num_heads - old_q) if proj == "q" else (num_kv_heads - old_kv)
            out[name] = torch.cat([weight, weight.new_zeros(new * head_dim, weight.shape[1])])
    if found != {"q", "k", "v", "o"}:
        raise ValueError(f"no complete attention projections in the weights (found {found})")
    return out, dict(config, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                     head_dim=head_dim)
