"""Tree attention over vLLM's CPU paged-cache layout, block-wise and batched.

vLLM's CPU kernels (ISA "vec"/"vec16") keep one ``[blocks, KVH, block_size, 2*Dh]``
allocation per layer in which each (block, KV head) holds K transposed
(``[Dh, block_size]``) followed by V (``[block_size, Dh]``). Gathering whole
blocks copies contiguous memory, which is several times faster than gathering
single positions through a permuted view; the per-step parts (masks, indices)
are built once and reused by all layers.

Same function as ``reference.paged_tree_attention`` (tests compare the two).
No vLLM import here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from vllm_treespec.attention.metadata import PagedTreeAttentionMetadata
from vllm_treespec.attention.reference import attention_mask


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a CPU paged cache as [blocks, block_size, KVH, Dh] views."""
    nb, kvh, bs, _ = kv_cache.shape
    flat = kv_cache.view(nb, kvh, 2 * bs * head_size)
    k = flat[..., : bs * head_size].view(nb, kvh, head_size, bs).permute(0, 3, 1, 2)
    v = flat[..., bs * head_size:].view(nb, kvh, bs, head_size).permute(0, 2, 1, 3)
    return k, v


def slot_elements(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``kv_cache.view(-1)`` of every element a slot holds
    (K and V of every KV head), [len(slots) * KVH * 2 * Dh], slot-major.

    With these, whole slots move cache to cache in two indexing ops per layer
    (``flat.index_copy_(0, dst, flat.index_select(0, src))``), however many there
    are; the layout (K transposed per block and head) is resolved once here."""
    _, kvh, bs, two_dh = kv_cache.shape
    dh = two_dh // 2
    blk, off = (slots // bs).view(-1, 1, 1), (slots % bs).view(-1, 1, 1)
    head = torch.arange(kvh, device=slots.device).view(1, -1, 1)
    d = torch.arange(dh, device=slots.device).view(1, 1, -1)
    base = (blk * kvh + head) * (2 * bs * dh)
    k = base + d * bs + off            # K^T: [Dh, block_size] per (block, head)
    v = base + bs * dh + off * dh + d  # V: [block_size, Dh]
    return torch.stack([k, v], 2).reshape(-1)


def move_cache_slots(caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """KV of (block, offset) pairs ``src`` [N, 2] copied to ``dst`` in every cache
    of ``caches`` (None entries skipped; a storage listed twice moved once: a move
    done twice is wrong, a destination is also a source), all read before any is
    written: two indexing ops a layer on the flat cache (``slot_elements``), the
    indices computed once per cache shape."""
    elements: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    seen = set()
    for cache in caches:
        if cache is None or cache.data_ptr() in seen:
            continue
        seen.add(cache.data_ptr())
        shape = tuple(cache.shape)
        if shape not in elements:
            bs = shape[2]
            elements[shape] = (slot_elements(cache, src[:, 0] * bs + src[:, 1]),
                               slot_elements(cache, dst[:, 0] * bs + dst[:, 1]))
        read, write = elements[shape]
        flat = cache.view(-1)
        flat.index_copy_(0, write, flat.index_select(0, read))


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor,
                  head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of a CPU cache -> dense K, V as [B, KVH, nblk*block_size, Dh].

    blocks: [B, nblk] physical block ids (entries past a request's length may be
    anything valid; the caller masks those positions).
    """
    B, nblk = blocks.shape
    _, kvh, bs, _ = kv_cache.shape
    raw = kv_cache[blocks.long()].view(B, nblk, kvh, 2, bs * head_size)
    k = raw[:, :, :, 0].view(B, nblk, kvh, head_size, bs)
    v = raw[:, :, :, 1].view(B, nblk, kvh, bs, head_size)
    k = k.permute(0, 2, 1, 4, 3).reshape(B, kvh, nblk * bs, head_size)
    v = v.permute(0, 2, 1, 3, 4).reshape(B, kvh, nblk * bs, head_size)
    return k, v


@dataclasses.dataclass
class TreeAttentionPlan:
    """Per-step, layer-independent inputs of ``tree_attention``."""

    blocks: torch.Tensor      # [B, nblk]
    q_index: torch.Tensor     # [B, Q] query row of each (request, node); clamped
    q_valid: torch.Tensor     # [B, Q]
    bias: torch.Tensor        # [B, 1, Q, nblk*block_size] additive mask (0 / -inf)
    out_rows: torch.Tensor    # [Nv] flat output rows of the valid (request, node) pairs
    _layer_inputs: dict = dataclasses.field(default_factory=dict)

    def layer_inputs(self, kv_heads: int, head_size: int, block_size: int, group: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids, grouped bias) for ``tree_attention``; built by the first layer
        of a step, shared by the others.

        The cache viewed as rows of ``block_size`` elements holds, per (block, KV
        head), Dh rows of K^T followed by Dh rows of V (V's [block_size, Dh] is
        Dh such rows). Ordering the row ids (request, head, d, block) for K^T and
        (request, head, block, r) for V makes one ``index_select`` return K^T as
        [B, KVH, Dh, L] and V as [B, KVH, L, Dh], both contiguous. The bias is
        repeated for the ``group`` query heads that share a KV head.
        """
        key = (kv_heads, head_size, block_size, group, dtype)
        if key not in self._layer_inputs:
            B, nblk = self.blocks.shape
            dev = self.blocks.device
            chunk = ((self.blocks.long().view(B, 1, nblk) * kv_heads
                      + torch.arange(kv_heads, device=dev).view(1, kv_heads, 1)) * 2 * head_size)
            d = torch.arange(head_size, device=dev)
            k_rows = chunk.unsqueeze(2) + d.view(1, 1, head_size, 1)               # [B, H, Dh, n]
            v_rows = chunk.unsqueeze(3) + head_size + d.view(1, 1, 1, head_size)   # [B, H, n, Dh]
            rows = torch.cat([k_rows.reshape(B, kv_heads, -1), v_rows.reshape(B, kv_heads, -1)],
                             dim=2).reshape(-1)
            _, _, Q, L = self.bias.shape
            bias = self.bias.to(dtype).expand(B, group, Q, L).reshape(B, 1, group * Q, L)
            self._layer_inputs[key] = (rows, bias.contiguous())
        return self._layer_inputs[key]


def plan(meta: PagedTreeAttentionMetadata, dtype: torch.dtype) -> TreeAttentionPlan:
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    Q = meta.max_query_len if meta.max_query_len is not None else int(q_lens.max())
    L = meta.max_seq_len if meta.max_seq_len is not None else int(meta.seq_lens.max())
    nblk = max(1, -(-L // meta.block_size))
    nblk = min(nblk, meta.block_table.shape[1])
    Lp = nblk * meta.block_size
    dev = meta.seq_lens.device
    cols = torch.arange(Q, device=dev)
    q_index = qsl[:-1].unsqueeze(1) + cols
    q_valid = cols.unsqueeze(0) < q_lens.unsqueeze(1)
    allowed = attention_mask(meta, Q, Lp)
    # Positions past a request's length are masked by attention_mask already.
    bias = torch.zeros(allowed.shape, dtype=dtype, device=dev)
    bias.masked_fill_(~allowed, float("-inf"))
    total = int(qsl[-1])
    return TreeAttentionPlan(blocks=meta.block_table[:, :nblk],
                             q_index=q_index.clamp(max=max(total - 1, 0)), q_valid=q_valid,
                             bias=bias.unsqueeze(1), out_rows=q_index[q_valid])


def tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, p: TreeAttentionPlan,
                   scale: float) -> torch.Tensor:
    """query [N, H, Dh] (packed rows of the plan) -> [Nv, H, Dh] in plan order.

    One row gather per layer brings each request's K^T [KVH, Dh, L] and V
    [KVH, L, Dh] out of the cache already contiguous (``layer_rows``), so the
    attention is two plain matmuls with query heads grouped by KV head (GQA
    without repeating K/V). Per-layer work is a handful of large ops: at batch
    1 op overhead, not data, is what separates this from the native kernel.

    Garbage in never-written cache slots cannot leak: those keys are masked with
    -inf and non-finite values zeroed before the weighted sum.
    """
    _, H, Dh = query.shape
    B, nblk = p.blocks.shape
    _, kvh, bs, _ = kv_cache.shape
    G, Q, L = H // kvh, p.q_index.shape[1], nblk * bs
    acc = torch.float32  # accumulate in fp32 whatever the cache dtype (as kernels do)
    rows, bias = p.layer_inputs(kvh, Dh, bs, G, acc)
    kv = kv_cache.view(-1, bs).index_select(0, rows).view(B, kvh, 2, Dh * L)
    kv = kv.to(acc).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    k_t, v = kv[:, :, 0].view(B, kvh, Dh, L), kv[:, :, 1].view(B, kvh, L, Dh)
    q = (query[p.q_index].to(acc).view(B, Q, kvh, G, Dh).permute(0, 2, 3, 1, 4)
         .reshape(B, kvh, G * Q, Dh))                       # rows (g, node) per KV head
    scores = torch.addcmul(bias, torch.matmul(q, k_t), torch.tensor(scale, dtype=acc))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)    # [B, KVH, G*Q, Dh]
    out = out.view(B, kvh, G, Q, Dh).permute(0, 3, 1, 2, 4).reshape(B, Q, H, Dh)
    return out[p.q_valid].to(query.dtype)


def gather_prefix(kv_cache: torch.Tensor, block_table: torch.Tensor, prefix_len: torch.Tensor,
                  max_prefix_len: int, head_size: int, dtype: torch.dtype):
    """Dense prefix K/V [B, KVH, Lp, Dh] and its additive mask [B, 1, 1, Lp]."""
    bs = kv_cache.shape[2]
    nblk = min(max(1, -(-max_prefix_len // bs)), block_table.shape[1])
    k, v = gather_blocks(kv_cache, block_table[:, :nblk], head_size)
    k = k.to(dtype).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    v = v.to(dtype).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    pos = torch.arange(nblk * bs, device=kv_cache.device)
    bias = torch.zeros(prefix_len.shape[0], 1, 1, nblk * bs, dtype=dtype, device=kv_cache.device)
    bias.masked_fill_((pos.unsqueeze(0) >= prefix_len.long().unsqueeze(1)).view(bias.shape),
                      float("-inf"))
    return k, v, bias


def prefix_side_attention(query: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                          prefix_bias: torch.Tensor, side_key: torch.Tensor,
                          side_value: torch.Tensor, side_mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Drafting-level attention with a pre-gathered prefix (see reference.prefix_side_attention).

    query [B, F, H, Dh]; prefix_k/v [B, KVH, Lp, Dh]; side_key/value [B, W, KVH, Dh];
    side_mask [B, F, W] -> [B, F, H, Dh].
    """
    B, F_, H, _ = query.shape
    keys = torch.cat([prefix_k, side_key.to(prefix_k.dtype).transpose(1, 2)], dim=2)
    values = torch.cat([prefix_v, side_value.to(prefix_v.dtype).transpose(1, 2)], dim=2)
    side_bias = torch.zeros(side_mask.shape, dtype=prefix_bias.dtype, device=query.device)
    side_bias.masked_fill_(~side_mask.bool(), float("-inf"))
    bias = torch.cat([prefix_bias.expand(B, 1, F_, prefix_bias.shape[-1]),
                      side_bias.unsqueeze(1)], dim=3)
    q = query.to(keys.dtype).permute(0, 2, 1, 3)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale,
                                       enable_gqa=H != keys.shape[1])
    return o.permute(0, 2, 1, 3).to(query.dtype)
