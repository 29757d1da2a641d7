"""Paged tree attention for verify steps: one Triton kernel for every row kind.

A verify step's query rows come in three kinds that one launch serves: a
prefill chunk (causal inside its chunk), a decode row (a chunk of one) and the
nodes of a draft tree. Every row of request ``b`` sees the request's committed
prefix ``[0, ctx)`` (``ctx = seq_len - q_len``) in the paged cache; inside its
own query block, row ``j`` sees block position ``j'`` iff

* tree rows: bit ``j'`` of the row's ancestor bitmask is set (ancestor or self);
* other rows: ``j' <= j`` (causal).

The tree comes as a compact bitmask, ``ceil(T / 32)`` int32 words per row (T =
the widest query block of a tree request), built once per step by
:func:`tree_row_metadata` and shared by all layers. Nodes are in topological
order (a parent before its children, as ``TreeBatch`` lays them out), so a
row's keys end at its own slot: ``ctx + j + 1`` positions, the causal bound.

The kernel reads K/V straight from the paged cache through ``block_table``
(any ``[blocks, block_size, KVH, D]`` view, strides given: vLLM's layout,
vllm-ascend's per-layer ``(K, V)`` pair with block size 128, or the CPU
layout's permuted views) with an online softmax in float32, so the tree costs
what a causal pass over the same keys costs plus one bit test per key of the
query block (the committed prefix needs none). One program computes a tile of
``BLOCK_M`` consecutive rows of one request for one KV head and all the query
heads that share it (GQA): the tile's rows x heads are the M axis of two matrix
products per key tile (scores, then values), so K/V are read once per tile and
the products run on the tensor / cube units.

Portability (the same source is meant for triton-ascend, which compiles Triton
for Ascend NPUs): only masked ``tl.load``/``tl.store``, ``tl.dot`` on tiles of at
least 16 x 16, ``tl.exp``/``tl.log``, ``tl.max``/``tl.sum``/``tl.where``, integer
shifts and ``range`` loops with runtime bounds. Avoided: atomics, block
pointers / TMA descriptors, inline assembly, libdevice calls. The only 64-bit
integers are the cache offsets (a cache can exceed 2^31 elements). On Ascend,
the grid's second axis (KV heads) is small; triton-ascend maps the programs
onto its AI cores.

Verified where: on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)
against the reference (``tests/unit/test_kernel_tree_attention.py``), and on an
H200 by the same tests and ``bench/tree_attention_kernel.py`` (README,
"Our kernel"). Not yet run on an Ascend NPU.
"""

from __future__ import annotations

import dataclasses
import math

import torch

try:  # the package imports without triton; only launching needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

BITS_PER_WORD = 32


@dataclasses.dataclass
class TreeRowMetadata:
    """Per query row facts of one verify step, shared by every layer.

    req:   [N] int32  request of the row
    ctx:   [N] int32  committed-prefix length of the row's request
    node:  [N] int32  index of the row inside its request's query block
    tree:  [N] int32  1 = the row follows ``bits``, 0 = causal
    bits:  [N, W] int32  ancestor-or-self bitmask over the query block (tree rows)
    end:   [N] int64  one past the last row of the row's request
    """

    req: torch.Tensor
    ctx: torch.Tensor
    node: torch.Tensor
    tree: torch.Tensor
    bits: torch.Tensor
    end: torch.Tensor
    _tiles: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def num_words(self) -> int:
        return self.bits.shape[1]

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first row, rows) of each kernel tile: ``block_m`` consecutive rows of
        one request. Built once per step (the first layer's call) and cached."""
        if block_m not in self._tiles:
            row0 = torch.nonzero(self.node % block_m == 0).flatten()
            rows = torch.clamp(self.end[row0] - row0, max=block_m)
            self._tiles[block_m] = (row0.to(torch.int32), rows.to(torch.int32))
        return self._tiles[block_m]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """[..., T] bool -> [..., ceil(T/32)] int32, bit ``t % 32`` of word ``t // 32``."""
    T = mask.shape[-1]
    words = max(1, math.ceil(T / BITS_PER_WORD))
    # One matmul with a [T, words] matrix of powers of two (bit t is worth
    # 2^(t % 32) in word t // 32; sums stay exact in float64): no padding, and
    # much cheaper than a broadcast int64 shift-and-sum.
    t = torch.arange(T, device=mask.device)
    weights = torch.zeros(T, words, dtype=torch.float64, device=mask.device)
    weights[t, t // BITS_PER_WORD] = 2.0 ** (t % BITS_PER_WORD).to(torch.float64)
    packed = (mask.to(torch.float64) @ weights).to(torch.int64)
    # Two's complement: bit 31 set means a negative int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def tree_row_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      tree_mask: torch.Tensor | None = None,
                      is_tree: torch.Tensor | None = None) -> TreeRowMetadata:
    """Row metadata from the reference's per-request description
    (``PagedTreeAttentionMetadata``: query offsets, KV lengths, a ``[B, T, T]``
    ancestor-or-self mask and which requests are trees). Vectorised: one call
    per step, no per-request Python loop."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    B = q_lens.shape[0]
    dev = qsl.device
    N = int(qsl[-1])
    req = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=N)
    node = torch.arange(N, device=dev) - qsl[:-1][req]
    ctx = (seq_lens.long() - q_lens)[req]
    if tree_mask is None:
        bits = torch.zeros(N, 1, dtype=torch.int32, device=dev)
        tree = torch.zeros(N, dtype=torch.int32, device=dev)
    else:
        T = tree_mask.shape[-1]
        per_req = pack_bits(tree_mask.bool())                        # [B, T, W]
        flags = (is_tree.bool() if is_tree is not None
                 else torch.ones(B, dtype=torch.bool, device=dev))
        in_mask = node < T
        bits = per_req[req, node.clamp(max=T - 1)]
        bits = torch.where(in_mask.unsqueeze(1), bits, torch.zeros_like(bits))
        tree = (flags[req] & in_mask).to(torch.int32)
        if bool(((q_lens > T) & flags).any()):
            raise ValueError(f"a tree request has more query rows than its {T}-wide mask")
    return TreeRowMetadata(req=req.to(torch.int32), ctx=ctx.to(torch.int32),
                           node=node.to(torch.int32), tree=tree, bits=bits.contiguous(),
                           end=qsl[1:][req])


if triton is not None:

    @triton.jit
    def _attend(q, acc, m_i, l_i, K, V, block_table, b, kvh, pos, in_range, visible, scale,
                block_size, stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                d, d_ok, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One key tile of the online softmax: ``visible`` [M, N] masks the scores."""
        # int64: a whole cache can exceed 2^31 elements (block id x block stride).
        page = tl.load(block_table + b * stride_bt + pos // block_size,
                       mask=in_range, other=0).to(tl.int64)
        slot = pos % block_size
        kv_mask = in_range[:, None] & d_ok[None, :]
        k = tl.load(K + page[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale       # [M, N]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m at -inf: shift by 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(V + page[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _tree_attention_kernel(
            Q, K, V, O, LSE, block_table, tile_row0, tile_rows, row_req, row_ctx, row_node,
            row_tree, row_bits, scale, block_size, num_words, num_rows,
            stride_qt, stride_qh, stride_qd,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            stride_ot, stride_oh, stride_od, stride_bt,
            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_LSE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        row0 = tl.load(tile_row0 + tile)
        nrows = tl.load(tile_rows + tile)
        b = tl.load(row_req + row0)          # a tile never crosses requests
        ctx = tl.load(row_ctx + row0)
        # The tile's BLOCK_M query rows x BLOCK_G heads sharing one KV head, flattened
        # into the M axis of the matrix products (m = r * BLOCK_G + g).
        m = tl.arange(0, BLOCK_M * BLOCK_G)
        r = m // BLOCK_G
        g = m % BLOCK_G
        row = row0 + r
        row_ok = (r < nrows) & (g < GROUP)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        node = tl.load(row_node + row, mask=row_ok, other=0)
        causal = tl.load(row_tree + row, mask=row_ok, other=0) == 0
        q = tl.load(Q + row[:, None] * stride_qt + heads[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        # The committed prefix [0, ctx): every row sees every key, no bit tests.
        # With several splits, each takes a slice of it (whole key tiles) and the
        # partial results are merged by their log-sum-exp (tree_attention).
        per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), splits) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(ctx, lo + per_split)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            in_range = pos < hi
            acc, m_i, l_i = _attend(
                q, acc, m_i, l_i, K, V, block_table, b, kvh, pos, in_range,
                row_ok[:, None] & in_range[None, :], scale, block_size,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, d, d_ok, PRECISION, UPCAST)
        # The query block [ctx, ctx + last + 1): slot j' is visible to row j iff
        # j' <= j and (the row is causal or bit j' of its ancestor mask is set).
        # Rows are in topological order, so the tile's last row bounds them all.
        # The last split takes it.
        last = tl.load(row_node + row0 + nrows - 1)
        block_end = tl.where(split == splits - 1, last + 1, 0)
        for start in range(0, block_end, BLOCK_N):
            rel = start + n
            in_range = rel <= last
            # Non-tree rows hold zero words (and prefill rows may run past them).
            word = tl.load(row_bits + row[:, None] * num_words + rel[None, :] // 32,
                           mask=row_ok[:, None] & in_range[None, :]
                           & (rel[None, :] < num_words * 32), other=0)
            bit = (word >> (rel[None, :] % 32)) & 1
            visible = (row_ok[:, None] & (rel[None, :] <= node[:, None])
                       & (causal[:, None] | (bit != 0)))
            acc, m_i, l_i = _attend(
                q, acc, m_i, l_i, K, V, block_table, b, kvh, ctx + rel, in_range, visible,
                scale, block_size, stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, d, d_ok, PRECISION, UPCAST)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        row = row + split * num_rows          # split s writes rows [s * N, (s + 1) * N)
        tl.store(O + row[:, None] * stride_ot + heads[:, None] * stride_oh
                 + d[None, :] * stride_od, out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        if HAS_LSE:
            # A split that saw no key has l = 0: its log-sum-exp is -inf (weight 0).
            lse = m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))
            tl.store(LSE + row * GROUP * tl.num_programs(1) + heads,
                     tl.where(l_i == 0.0, float("-inf"), lse), mask=row_ok)


def interpreter_enabled() -> bool:
    """Whether the kernel was compiled for Triton's CPU interpreter: triton reads
    ``TRITON_INTERPRET`` when the module is imported, not when it launches."""
    return triton is not None and type(_tree_attention_kernel).__name__ == "InterpretedFunction"


def _check_launchable(query: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("vllm_treespec.kernels.tree_attention needs the triton package "
                           "(pip install triton, or triton-ascend on an Ascend NPU)")
    if query.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("the Triton tree-attention kernel got CPU tensors, but no Triton "
                           "device runs them: use a CUDA or Ascend (triton-ascend) device, "
                           "or set TRITON_INTERPRET=1 before this module is imported "
                           "(tests only: the interpreter is far too slow to serve)")


def launch_config(device_type: str, head_size: int, group: int, dtype: torch.dtype) -> dict:
    """Tile sizes per backend. A tile is BLOCK_M query rows times the GQA group
    (padded to a power of two): 64 rows of the matrix products on GPUs and NPUs,
    16 (the products' minimum) under the interpreter; key tiles of 64 positions on
    GPUs, 128 on Ascend (its KV block size, one page per tile), 16 under the
    interpreter (small shapes, fast tests). fp32 inputs multiply in full precision
    (no TF32: the fp32 path is the one checked against the reference). The
    interpreter multiplies in fp32 (its bf16 products are wrong: garbage)."""
    block_g = triton.next_power_of_2(group)
    rows = {"cuda": 64, "npu": 64}.get(device_type, 16)
    return {"BLOCK_N": {"cuda": 64, "npu": 128}.get(device_type, 16), "BLOCK_G": block_g,
            "BLOCK_M": max(1, rows // block_g),
            "BLOCK_D": max(16, triton.next_power_of_2(head_size)),
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "UPCAST": device_type == "cpu"}


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, block_size: int, rows: TreeRowMetadata,
                   scale: float, out: torch.Tensor | None = None,
                   return_lse: bool = False, num_splits: int | None = None,
                   max_seq_len: int | None = None):
    """Attention of packed ``query`` [N, H, D] over a paged cache.

    key_cache / value_cache: [blocks, block_size, KVH, D] views (any strides)
    already holding this step's K/V; block_table [B, max_blocks] int32; rows from
    :func:`tree_row_metadata`. Returns ``out`` [N, H, D] in the query's dtype,
    and with ``return_lse`` also the log-sum-exp of the scaled scores [N, H]
    (float32), for merging with another pass. ``num_splits``: programs sharing
    each tile's committed prefix (default: :func:`prefix_splits`, which splits
    only when given ``max_seq_len``, the longest KV length in the batch).
    """
    _check_launchable(query)
    N, H, D = query.shape
    KVH = key_cache.shape[2]
    if H % KVH:
        raise ValueError(f"{H} query heads do not group over {KVH} KV heads")
    if key_cache.shape[1] != block_size or value_cache.shape != key_cache.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} "
                         f"do not match block_size {block_size}")
    group = H // KVH
    if out is None:
        out = torch.empty_like(query)
    if not N:
        lse = torch.empty(0, H, dtype=torch.float32, device=query.device)
        return (out, lse) if return_lse else out
    bt = block_table.to(torch.int32).contiguous()
    cfg = launch_config(query.device.type, D, group, query.dtype)
    tile_row0, tile_rows = rows.tiles(cfg["BLOCK_M"])
    splits = num_splits or prefix_splits(query.device, tile_row0.shape[0] * KVH, max_seq_len)
    if splits == 1:
        o_rows = out
        lse = torch.empty(N, H, dtype=torch.float32, device=query.device) if return_lse else out
    else:  # partial results per split, merged below
        o_rows = torch.empty(splits * N, H, D, dtype=torch.float32, device=query.device)
        lse = torch.empty(splits * N, H, dtype=torch.float32, device=query.device)
    _tree_attention_kernel[(tile_row0.shape[0], KVH, splits)](
        query, key_cache, value_cache, o_rows, lse, bt, tile_row0, tile_rows, rows.req,
        rows.ctx, rows.node, rows.tree, rows.bits, float(scale), block_size,
        rows.num_words, N,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *o_rows.stride(),
        bt.stride(0), GROUP=group, HEAD_DIM=D, HAS_LSE=return_lse or splits > 1, **cfg)
    if splits > 1:
        part_lse = lse.view(splits, N, H)
        lse = torch.logsumexp(part_lse, dim=0)
        weights = torch.exp(part_lse - lse).unsqueeze(-1)      # a split with no keys: 0
        out.copy_((weights * o_rows.view(splits, N, H, D)).sum(dim=0))
    return (out, lse) if return_lse else out


_SM_COUNT: dict[int, int] = {}


def prefix_splits(device: torch.device, programs: int, max_seq_len: int | None,
                  max_splits: int = 16, keys_per_split: int = 512) -> int:
    """How many programs share each tile's committed prefix (flash-decoding).

    A GPU with fewer programs than multiprocessors idles (batch 1: one tile per
    KV head), so a long prefix is split until there are about twice as many, each
    split keeping at least ``keys_per_split`` keys. The merge costs five more
    launches: it pays inside a CUDA graph, where launches are nearly free, but not
    eagerly, where the launches cost more than the work they split (timings:
    benchmarks/RESULTS.md, "Triton tree-attention kernel", and
    benchmarks/history/RESULTS-history.md, "Latest (2026-11-26, morning): the
    Triton tree kernel on an H200"), so without ``max_seq_len`` (the longest
    sequence, which callers capturing graphs know on the host) and off CUDA it
    is 1."""
    if device.type != "cuda" or max_seq_len is None:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sms = _SM_COUNT[index]
    if programs >= sms:
        return 1
    return max(1, min(max_splits, -(-2 * sms // programs), max_seq_len // keys_per_split))
