"""Reference tree attention over a paged KV cache, in plain torch.

The oracle every device backend is compared with, and the eager ("reference")
execution path on any device. Semantics for request b with ``q_len`` query
tokens and ``seq_len`` KV entries (the query's own KV already written at the
end, positions ``ctx .. seq_len-1`` with ``ctx = seq_len - q_len``):

* every query token sees the whole context ``[0, ctx)``;
* inside the query block, query j sees query j' iff
  ``tree_mask[b, j, j']`` for tree rows (``is_tree[b]``), else ``j' <= j`` (causal).

Grouped-query attention: query head h reads KV head ``h // (H / KVH)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_treespec.attention.metadata import PagedTreeAttentionMetadata


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                    block_size: int) -> torch.Tensor:
    """[num_blocks, block_size, KVH, Dh] paged cache -> [B, length, KVH, Dh] dense."""
    pos = torch.arange(length, device=cache.device)
    logical = torch.div(pos, block_size, rounding_mode="floor")
    logical = logical.clamp(max=block_table.shape[1] - 1)  # past seq_len: masked later
    blocks = block_table[:, logical].long()  # [B, length]
    return cache[blocks, (pos % block_size).unsqueeze(0)]


def attention_mask(meta: PagedTreeAttentionMetadata, max_query_len: int,
                   max_seq_len: int) -> torch.Tensor:
    """[B, Qmax, Lmax] bool: may query j of request b attend to KV position c."""
    qsl, seq_lens = meta.query_start_loc.long(), meta.seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    ctx = (seq_lens - q_lens).view(-1, 1, 1)
    dev = seq_lens.device
    row = torch.arange(max_query_len, device=dev).view(1, -1, 1)
    col = torch.arange(max_seq_len, device=dev).view(1, 1, -1)
    rel = col - ctx  # position of the key inside the query block
    in_query = (rel >= 0) & (rel < q_lens.view(-1, 1, 1))
    intra = rel <= row  # causal
    if meta.tree_mask is not None:
        tm = meta.tree_mask.bool()
        Tq = tm.shape[-1]
        pad = max(0, max_query_len - Tq)
        tm = F.pad(tm, (0, pad, 0, pad))[:, :max_query_len, :max_query_len]
        idx = rel.clamp(0, max_query_len - 1).expand(tm.shape[0], max_query_len, -1)
        tree_intra = torch.gather(tm, 2, idx)
        is_tree = (meta.is_tree.bool() if meta.is_tree is not None
                   else torch.ones(tm.shape[0], dtype=torch.bool, device=dev))
        intra = torch.where(is_tree.view(-1, 1, 1), tree_intra, intra)
    allowed = (col < ctx) | (in_query & intra)
    # Padding query rows attend to position 0 only (finite softmax, discarded).
    row_ok = row < q_lens.view(-1, 1, 1)
    return torch.where(row_ok, allowed, col == 0)


def paged_tree_attention(query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, meta: PagedTreeAttentionMetadata,
                         scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [N, H, Dh] over a paged cache [blocks, block_size, KVH, Dh].

    Returns [N, H, Dh] in the query's dtype (computed in float32).
    """
    N, H, Dh = query.shape
    KVH = key_cache.shape[2]
    qsl = meta.query_start_loc.long()
    B = qsl.shape[0] - 1
    q_lens = qsl[1:] - qsl[:-1]
    Q = meta.max_query_len if meta.max_query_len is not None else int(q_lens.max())
    L = meta.max_seq_len if meta.max_seq_len is not None else int(meta.seq_lens.max())
    k = gather_paged_kv(key_cache, meta.block_table, L, meta.block_size)
    v = gather_paged_kv(value_cache, meta.block_table, L, meta.block_size)
    # Slots past a request's length hold whatever the cache held (other requests'
    # data, never-written memory, even NaN). Masking alone is not enough: a masked
    # weight of 0 times NaN is NaN. Zero them.
    written = (torch.arange(L, device=k.device).unsqueeze(0)
               < meta.seq_lens.long().unsqueeze(1)).view(B, L, 1, 1)
    k = torch.where(written, k, 0.0)
    v = torch.where(written, v, 0.0)
    q_idx = qsl[:-1].unsqueeze(1) + torch.arange(Q, device=query.device)
    q_ok = torch.arange(Q, device=query.device).unsqueeze(0) < q_lens.unsqueeze(1)
    q_pad = query[q_idx.clamp(max=max(N - 1, 0))]  # [B, Q, H, Dh]
    mask = attention_mask(meta, Q, L)
    group = H // KVH
    qh = q_pad.float().permute(0, 2, 1, 3)                                # [B, H, Q, Dh]
    kh = k.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)   # [B, H, L, Dh]
    vh = v.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.unsqueeze(1), scale=scale)
    o = o.permute(0, 2, 1, 3).to(query.dtype)                            # [B, Q, H, Dh]
    if out is None:
        out = torch.empty_like(query)
    out[q_idx[q_ok]] = o[q_ok]
    return out


def prefix_side_attention(query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_table: torch.Tensor,
                          block_size: int, prefix_len: torch.Tensor,
                          side_key: torch.Tensor, side_value: torch.Tensor,
                          side_mask: torch.Tensor, scale: float,
                          max_prefix_len: int | None = None) -> torch.Tensor:
    """Attention over a paged prefix plus a dense "side" block of tree nodes.

    Used while *drafting* a tree: the frontier nodes of the current level attend
    to the whole committed prefix (paged cache, ``prefix_len[b]`` entries) and to
    the draft nodes of earlier levels that are their ancestors, whose K/V live
    in a small dense side buffer rather than in the paged cache.

    query:      [B, Q, H, Dh]
    side_key/side_value: [B, W, KVH, Dh]
    side_mask:  [B, Q, W] bool (may query q see side entry w)
    Returns [B, Q, H, Dh] in the query's dtype (float32 math).
    """
    B, Q, H, Dh = query.shape
    KVH = side_key.shape[2]
    L = max_prefix_len if max_prefix_len is not None else int(prefix_len.max())
    L = max(L, 1)
    k = gather_paged_kv(key_cache, block_table, L, block_size)
    v = gather_paged_kv(value_cache, block_table, L, block_size)
    in_prefix = (torch.arange(L, device=query.device).unsqueeze(0)
                 < prefix_len.long().unsqueeze(1))                      # [B, L]
    k = torch.where(in_prefix.view(B, L, 1, 1), k, 0.0)
    v = torch.where(in_prefix.view(B, L, 1, 1), v, 0.0)
    keys = torch.cat([k.float(), side_key.float()], dim=1)             # [B, L+W, KVH, Dh]
    values = torch.cat([v.float(), side_value.float()], dim=1)
    mask = torch.cat([in_prefix.unsqueeze(1).expand(B, Q, L), side_mask.bool()], dim=2)
    group = H // KVH
    qh = query.float().permute(0, 2, 1, 3)
    kh = keys.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vh = values.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.unsqueeze(1), scale=scale)
    return o.permute(0, 2, 1, 3).to(query.dtype)
