"""A CPU emulation of the torch_npu attention contract the Ascend backend relies on.

Written from the documentation only (torch_npu's ``npu_fused_infer_attention_score``
and ``npu_fused_infer_attention_score_v2`` pages, CANN's sparse-mode table and
``AttentionUpdate`` page); no Ascend code or hardware was involved. It computes
what the documents say the ops compute and rejects, with
:class:`FIAContractError`, argument combinations the documents rule out, so that
a wrong layout, mask shape, sparse mode or length convention fails here instead
of on a device. What the documents leave open is emulated conservatively:

* query rows past ``actual_seq_lengths`` (padding) come back as NaN, so any use
  of them is visible;
* a query row whose mask hides every key is NaN unless ``inner_precise`` has
  bit 1 ("invalid row" correction), which zeroes it;
* features the backend does not use (quantisation, pse, prefixes, left padding,
  sparse modes 4-8, pre/next token bands under a user mask) raise
  ``NotImplementedError`` rather than guess.

What it cannot tell: whether CANN accepts a combination the docs allow (notably
``sparse_mode=9`` for bf16 GQA through the v2 API), bf16/fp16 rounding inside the
kernels (everything here is float32 math), performance, and graph capture.

Supported: layouts TND, BSND, BSH, BNSD; paged KV (``block_table``, block size
128..512 step 128, cache ``(blocks, block, KVH*D)`` or, for TND/BNSD, ``(blocks,
KVH, block, D)``) and dense KV; ``actual_seq_lengths(_kv)`` conventions (TND query
lengths cumulative; paged KV lengths per request; dense TND KV lengths
cumulative; other layouts per request, a single value broadcasts); sparse modes
0, 1, 2, 3 and 9 with their mask layouts and alignments; GQA; ``softmax_lse``;
``npu_attention_update``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

INT32_MAX = 2147483647
_HALF_TYPES = (torch.float16, torch.bfloat16)


_COMPRESSED: list[torch.Tensor] = []


def _compressed_causal() -> torch.Tensor:
    if not _COMPRESSED:
        _COMPRESSED.append(torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    return _COMPRESSED[0]


class FIAContractError(ValueError):
    """An argument combination the torch_npu documentation does not allow."""


def _fail(op: str, what: str) -> FIAContractError:
    return FIAContractError(f"{op}: {what}")


def _ints(x) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _per_batch(op: str, name: str, values: list[int] | None, batch: int,
               default: int) -> list[int]:
    """Non-TND length lists: None = the shape's S; one value broadcasts; a longer
    list contributes its first ``batch`` entries; anything else is rejected."""
    if values is None:
        return [default] * batch
    if len(values) == 1:
        return values * batch
    if len(values) >= batch:
        return values[:batch]
    raise _fail(op, f"{name} has {len(values)} entries for batch {batch} (allowed: 1 "
                    f"or at least the batch size)")


def _cumulative(op: str, name: str, values: list[int] | None) -> list[int]:
    if values is None:
        raise _fail(op, f"{name} is required with input_layout TND")
    prev = 0
    for v in values:
        if v < prev:
            raise _fail(op, f"{name} must be cumulative (non-decreasing, >= 0) in TND: "
                            f"{values}")
        prev = v
    return [b - a for a, b in zip([0] + values[:-1], values)]


class EmulatedTorchNPU:
    """Stand-in for the ``torch_npu`` namespace: the three ops the backend issues.

    ``calls`` logs (op, layout, sparse_mode, lengths, mask shape) of every call.
    ``allow_float32`` admits float32 tensors (the ops take fp16/bf16) so tests can
    compare at tight tolerances.
    """

    def __init__(self, allow_float32: bool = True):
        self.allow_float32 = allow_float32
        self.calls: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ v1
    def npu_fused_infer_attention_score(
            self, query, key, value, *, pse_shift=None, atten_mask=None,
            actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
            num_heads=1, scale=1.0, pre_tokens=INT32_MAX, next_tokens=INT32_MAX,
            input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
            block_size=0, antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
            value_antiquant_mode=0, **others):
        op = "npu_fused_infer_attention_score"
        self._unemulated(op, dict(others, pse_shift=pse_shift))
        if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
            raise NotImplementedError(f"{op}: quantised KV is not emulated")
        return self._fia(op, False, query, key, value, atten_mask, actual_seq_lengths,
                         actual_seq_lengths_kv, block_table, num_heads, num_key_value_heads,
                         scale, pre_tokens, next_tokens, input_layout, sparse_mode,
                         inner_precise, block_size, softmax_lse_flag)

    # ------------------------------------------------------------------ v2
    def npu_fused_infer_attention_score_v2(
            self, query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
            atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None,
            num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
            pre_tokens=INT32_MAX, next_tokens=INT32_MAX, input_layout="BSH", sparse_mode=0,
            block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0,
            inner_precise=0, return_softmax_lse=False, **others):
        op = "npu_fused_infer_attention_score_v2"
        self._unemulated(op, dict(others, query_rope=query_rope, key_rope=key_rope,
                                  pse_shift=pse_shift))
        if query_quant_mode or key_quant_mode or value_quant_mode:
            raise NotImplementedError(f"{op}: quantisation is not emulated")
        return self._fia(op, True, query, key, value, atten_mask, actual_seq_qlen,
                         actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                         softmax_scale, pre_tokens, next_tokens, input_layout, sparse_mode,
                         inner_precise, block_size, return_softmax_lse)

    # ------------------------------------------------------------------ update
    def npu_attention_update(self, lse: Sequence[torch.Tensor],
                             local_out: Sequence[torch.Tensor], update_type: int):
        """O = sum_i O_i exp(lse_i - lse_m), lse_m = logsumexp_i lse_i (per row)."""
        op = "npu_attention_update"
        lse, local_out = list(lse), list(local_out)
        sp = len(lse)
        if sp != len(local_out) or not 1 <= sp <= 16:
            raise _fail(op, f"{sp} lse and {len(local_out)} outputs (need equal counts "
                            f"in [1, 16])")
        if update_type != 0:
            raise NotImplementedError(f"{op}: update_type {update_type} is not emulated")
        M, D = local_out[0].shape if local_out[0].dim() == 2 else (None, None)
        if M is None:
            raise _fail(op, f"local outputs must be 2-D [rows, D], got "
                            f"{tuple(local_out[0].shape)}")
        if not (8 <= D <= 512 and D % 8 == 0):
            raise _fail(op, f"head dim {D} outside [8, 512] or not a multiple of 8")
        for l_i, o_i in zip(lse, local_out):
            if l_i.dtype != torch.float32 or tuple(l_i.shape) != (M,):
                raise _fail(op, f"lse must be float32 [{M}], got {l_i.dtype} "
                                f"{tuple(l_i.shape)}")
            if tuple(o_i.shape) != (M, D) or o_i.dtype != local_out[0].dtype:
                raise _fail(op, "local outputs must share shape and dtype")
            if not (l_i.is_contiguous() and o_i.is_contiguous()):
                raise _fail(op, "non-contiguous tensors are not supported")
        L = torch.stack([x.float() for x in lse])                    # [sp, M]
        lse_m = torch.logsumexp(L, dim=0)
        w = torch.exp(L - lse_m)                                      # [sp, M]
        out = sum(w[i].unsqueeze(1) * local_out[i].float() for i in range(sp))
        self.calls.append({"op": op, "sp": sp, "rows": M})
        return out.to(local_out[0].dtype), lse_m

    # ------------------------------------------------------------------ core
    @staticmethod
    def _unemulated(op: str, extras: dict[str, Any]) -> None:
        for name, v in extras.items():
            if v is not None and not (isinstance(v, (int, float, bool)) and not v):
                raise NotImplementedError(f"{op}: argument {name!r} is not emulated")

    def _check_dtype(self, op: str, query, key, value) -> None:
        ok = _HALF_TYPES + ((torch.float32,) if self.allow_float32 else ())
        if query.dtype not in ok:
            raise _fail(op, f"query dtype {query.dtype} (supported: float16, bfloat16)")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise _fail(op, f"key/value dtype {key.dtype}/{value.dtype} differs from the "
                            f"query's {query.dtype} (quantised KV is not emulated)")

    def _fia(self, op, v2, query, key, value, mask, q_arg, kv_arg, block_table, num_heads,
             num_kv_heads, scale, pre_tokens, next_tokens, layout, sparse_mode,
             inner_precise, block_size, want_lse):
        self._check_dtype(op, query, key, value)
        for name, t in (("query", query), ("key", key), ("value", value),
                        ("atten_mask", mask), ("block_table", block_table)):
            if t is not None and not t.is_contiguous():
                raise _fail(op, f"{name} is not contiguous (not supported)")
        if inner_precise not in (0, 1, 2, 3):
            raise _fail(op, f"inner_precise {inner_precise} (allowed 0..3)")
        H = int(num_heads)
        KVH = int(num_kv_heads) or H
        if H % KVH or H // KVH > 64:
            raise _fail(op, f"num_heads {H} / num_key_value_heads {KVH}: must divide, "
                            f"ratio <= 64")

        # ---- query layout -> per-batch query rows ---------------------------
        q_lens_arg = _ints(q_arg)
        if layout == "TND":
            if query.dim() != 3:
                raise _fail(op, f"TND query must be 3-D, got {tuple(query.shape)}")
            Ttok, N, D = query.shape
            q_lens = _cumulative(op, "actual_seq_lengths", q_lens_arg)
            if q_lens_arg and q_lens_arg[-1] > Ttok:
                raise _fail(op, f"actual_seq_lengths end at {q_lens_arg[-1]} > T={Ttok}")
            B = len(q_lens)
            starts = [0] + q_lens_arg[:-1]
            q_rows = [query[s: s + n] for s, n in zip(starts, q_lens)]    # [n, N, D]
            Q_S = None
        elif layout in ("BSND", "BSH", "BNSD"):
            if layout == "BSH":
                if query.dim() != 3 or query.shape[2] % H:
                    raise _fail(op, f"BSH query {tuple(query.shape)} with {H} heads")
                B, Q_S = query.shape[:2]
                q4 = query.view(B, Q_S, H, -1)
            elif layout == "BSND":
                if query.dim() != 4:
                    raise _fail(op, f"BSND query must be 4-D, got {tuple(query.shape)}")
                B, Q_S = query.shape[:2]
                q4 = query
            else:
                if query.dim() != 4:
                    raise _fail(op, f"BNSD query must be 4-D, got {tuple(query.shape)}")
                B, Q_S = query.shape[0], query.shape[2]
                q4 = query.transpose(1, 2)
            N, D = q4.shape[2], q4.shape[3]
            q_lens = _per_batch(op, "actual_seq_lengths", q_lens_arg, B, Q_S)
            if any(not 0 <= q <= Q_S for q in q_lens):
                raise _fail(op, f"actual_seq_lengths {q_lens} exceed the query's S={Q_S}")
            q_rows = [q4[b, : q_lens[b]] for b in range(B)]
        else:
            raise NotImplementedError(f"{op}: input_layout {layout!r} is not emulated")
        if N != H:
            raise _fail(op, f"query has {N} heads but num_heads={H}")
        if D % 16 or D > 512:
            raise _fail(op, f"head dim {D}: must be a multiple of 16 and <= 512")
        if Q_S == 1 and inner_precise >= 2:
            raise _fail(op, "with Q_S == 1 inner_precise must be 0 or 1")

        # ---- KV -------------------------------------------------------------
        kv_lens_arg = _ints(kv_arg)
        if key.shape != value.shape:
            raise _fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        if block_table is not None:
            k_rows, v_rows, kv_lens, kv_s = self._paged(op, layout, key, value, block_table,
                                                        kv_lens_arg, block_size, B, KVH, D)
        else:
            k_rows, v_rows, kv_lens, kv_s = self._dense(op, layout, key, value, kv_lens_arg,
                                                        B, KVH, D)

        # ---- masks ------------------------------------------------------------
        allowed = self._masks(op, v2, layout, mask, sparse_mode, pre_tokens, next_tokens,
                              q_lens, kv_lens, B, Q_S, kv_s)

        # ---- compute ------------------------------------------------------------
        group = H // KVH
        out_rows, lse_rows = [], []
        for b in range(B):
            q = q_rows[b].float()                                          # [n, H, D]
            k = k_rows[b].float().repeat_interleave(group, dim=1)          # [L, H, D]
            v = v_rows[b].float().repeat_interleave(group, dim=1)
            s = torch.einsum("nhd,lhd->hnl", q, k) * float(scale)          # [H, n, L]
            a = allowed[b].unsqueeze(0)                                    # [1, n, L]
            s = s.masked_fill(~a, float("-inf"))
            lse = torch.logsumexp(s, dim=-1)                               # [H, n]
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("hnl,lhd->nhd", p, v)
            dead = ~a.any(-1).squeeze(0)                                   # [n]
            if bool(dead.any()):
                fill = 0.0 if inner_precise & 2 else float("nan")
                o[dead] = fill
            out_rows.append(o)
            lse_rows.append(lse.transpose(0, 1))                           # [n, H]

        nan = float("nan")
        out = torch.full(query.shape, nan, dtype=torch.float32)
        if layout == "TND":
            for b in range(B):
                out[starts[b]: starts[b] + q_lens[b]] = out_rows[b]
            lse_out = torch.full((query.shape[0], H, 1), nan)
            for b in range(B):
                lse_out[starts[b]: starts[b] + q_lens[b], :, 0] = lse_rows[b]
        else:
            o4 = torch.full((B, Q_S, H, D), nan)
            lse_out = torch.full((B, H, Q_S, 1), nan)
            for b in range(B):
                o4[b, : q_lens[b]] = out_rows[b]
                lse_out[b, :, : q_lens[b], 0] = lse_rows[b].transpose(0, 1)
            out = (o4.reshape(B, Q_S, H * D) if layout == "BSH"
                   else o4.transpose(1, 2).contiguous() if layout == "BNSD" else o4)
        if not want_lse:
            lse_out = torch.zeros(1)
        self.calls.append({"op": op, "layout": layout, "sparse_mode": sparse_mode,
                           "q_lens": q_lens, "kv_lens": kv_lens, "paged": block_table is not None,
                           "mask_shape": None if mask is None else tuple(mask.shape)})
        return out.to(query.dtype).to(query.device), lse_out.to(query.device)

    # ---- KV helpers ---------------------------------------------------------------
    def _paged(self, op, layout, key, value, table, kv_arg, block_size, B, KVH, D):
        if table.dtype != torch.int32 or table.dim() != 2:
            raise _fail(op, f"block_table must be 2-D int32, got {table.dtype} "
                            f"{tuple(table.shape)}")
        if table.shape[0] != B:
            raise _fail(op, f"block_table has {table.shape[0]} rows for batch {B}")
        if block_size not in (128, 256, 384, 512):
            raise _fail(op, f"block_size {block_size} (page attention: 128..512, multiple "
                            f"of 128)")
        if key.dim() == 3:
            nb, bs, hd = key.shape
            if hd != KVH * D:
                raise _fail(op, f"paged key (blocks, block, H) has H={hd}, expected "
                                f"num_key_value_heads*D={KVH * D}")
            k_blocks = key.view(nb, bs, KVH, D)
            v_blocks = value.view(nb, bs, KVH, D)
        elif key.dim() == 4 and layout in ("TND", "BNSD"):
            nb, kvh, bs, d = key.shape
            if (kvh, d) != (KVH, D):
                raise _fail(op, f"paged key (blocks, KVH, block, D) {tuple(key.shape)}")
            k_blocks = key.transpose(1, 2)
            v_blocks = value.transpose(1, 2)
        else:
            raise _fail(op, f"paged key {tuple(key.shape)} with layout {layout}: BSH/BSND "
                            f"take (blocks, block, KVH*D) only")
        if bs != block_size:
            raise _fail(op, f"cache blocks hold {bs} tokens but block_size={block_size}")
        if kv_arg is None:
            raise _fail(op, "page attention requires actual_seq_lengths_kv")
        kv_lens = _per_batch(op, "actual_seq_lengths_kv", kv_arg, B, 0)
        cap = table.shape[1] * bs
        for b, L in enumerate(kv_lens):
            if not 0 <= L <= cap:
                raise _fail(op, f"KV length {L} of batch {b} exceeds the block table's "
                                f"{cap} slots (paged KV lengths are per request)")
        # A user mask must cover at least max-blocks-per-sequence * block_size columns.
        need = -(-max(kv_lens, default=0) // bs) * bs
        k_rows, v_rows = [], []
        tbl = table.cpu()
        for b, L in enumerate(kv_lens):
            pos = torch.arange(L)
            blocks = tbl[b, pos // bs].long()
            if L and bool(((blocks < 0) | (blocks >= nb)).any()):
                raise _fail(op, f"block_table row {b} references a block outside the "
                                f"{nb}-block cache")
            k_rows.append(k_blocks[blocks.to(key.device), (pos % bs).to(key.device)])
            v_rows.append(v_blocks[blocks.to(key.device), (pos % bs).to(key.device)])
        return k_rows, v_rows, kv_lens, need

    def _dense(self, op, layout, key, value, kv_arg, B, KVH, D):
        if layout == "TND":
            if key.dim() != 3 or tuple(key.shape[1:]) != (KVH, D):
                raise _fail(op, f"TND key must be (T, KVH, D), got {tuple(key.shape)}")
            kv_lens = _cumulative(op, "actual_seq_lengths_kv", kv_arg)
            if len(kv_lens) != B:
                raise _fail(op, f"{len(kv_lens)} KV lengths for batch {B}")
            starts = [0] + kv_arg[:-1]
            if kv_arg and kv_arg[-1] > key.shape[0]:
                raise _fail(op, f"actual_seq_lengths_kv ends at {kv_arg[-1]} > "
                                f"{key.shape[0]} keys")
            return ([key[s: s + n] for s, n in zip(starts, kv_lens)],
                    [value[s: s + n] for s, n in zip(starts, kv_lens)], kv_lens, None)
        if layout == "BSH":
            k4, v4 = key.view(key.shape[0], key.shape[1], KVH, -1), value.view(
                value.shape[0], value.shape[1], KVH, -1)
        elif layout == "BNSD":
            k4, v4 = key.transpose(1, 2), value.transpose(1, 2)
        else:
            k4, v4 = key, value
        if k4.dim() != 4 or k4.shape[0] != B or tuple(k4.shape[2:]) != (KVH, D):
            raise _fail(op, f"dense {layout} key {tuple(key.shape)} for batch {B}, "
                            f"{KVH} KV heads, D={D}")
        S = k4.shape[1]
        kv_lens = _per_batch(op, "actual_seq_lengths_kv", kv_arg, B, S)
        if any(not 0 <= L <= S for L in kv_lens):
            raise _fail(op, f"actual_seq_lengths_kv {kv_lens} exceed the key's S={S}")
        return ([k4[b, :L] for b, L in enumerate(kv_lens)],
                [v4[b, :L] for b, L in enumerate(kv_lens)], kv_lens, S)

    # ---- mask helpers ---------------------------------------------------------------
    def _masks(self, op, v2, layout, mask, sparse_mode, pre_tokens, next_tokens, q_lens,
               kv_lens, B, Q_S, kv_s) -> list[torch.Tensor]:
        """Per batch a bool [q_b, kv_b] may-attend matrix."""
        if mask is not None and mask.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise _fail(op, f"atten_mask dtype {mask.dtype} (bool, int8 or uint8)")
        if layout == "TND":
            allowed_modes = {(0, False), (3, True)} | ({(9, True)} if v2 else set())
            if (sparse_mode, mask is not None) not in allowed_modes:
                raise _fail(op, f"TND allows sparse_mode 0 without a mask or 3 with the "
                                f"compressed mask{' (or 9 with a flat tree mask)' if v2 else ''}; "
                                f"got sparse_mode={sparse_mode} with"
                                f"{'' if mask is not None else 'out'} a mask")
        out = []
        if sparse_mode in (0, 1):
            if mask is None:
                if sparse_mode == 1:
                    raise _fail(op, "sparse_mode 1 (allMask) needs the full atten_mask")
                return [torch.ones(q, L, dtype=torch.bool) for q, L in zip(q_lens, kv_lens)]
            if sparse_mode == 0 and (pre_tokens != INT32_MAX or next_tokens != INT32_MAX):
                raise NotImplementedError(f"{op}: pre/next token bands with a user mask "
                                          f"are not emulated")
            m = mask.cpu()
            if m.dim() == 2:
                m = m.view(1, 1, *m.shape)
            elif m.dim() == 3:
                m = m.unsqueeze(1)
            if m.dim() != 4 or m.shape[1] != 1 or m.shape[0] not in (1, B):
                raise _fail(op, f"atten_mask {tuple(mask.shape)}: expected (Q_S, KV_S), "
                                f"(B|1, Q_S, KV_S) or (B|1, 1, Q_S, KV_S) with B={B}")
            need_rows = Q_S if Q_S is not None else max(q_lens)
            need_cols = kv_s if kv_s is not None else max(kv_lens)
            if m.shape[-1] < need_cols:
                raise _fail(op, f"atten_mask covers {m.shape[-1]} KV positions; the KV "
                                f"side needs {need_cols} (page attention: at least "
                                f"max blocks per sequence * block_size)")
            if m.shape[-2] < need_rows:
                raise _fail(op, f"atten_mask has {m.shape[-2]} query rows, the query "
                                f"has S={need_rows}")
            for b in range(B):
                mb = m[b if m.shape[0] == B else 0, 0]
                out.append(mb[: q_lens[b], : kv_lens[b]] == 0)
            return out
        if sparse_mode in (2, 3):
            self._check_compressed(op, mask)
            for q, L in zip(q_lens, kv_lens):
                i = torch.arange(q).unsqueeze(1)
                j = torch.arange(L).unsqueeze(0)
                out.append(j <= i + (L - q if sparse_mode == 3 else 0))
            return out
        if sparse_mode == 9:
            if not v2:
                raise _fail(op, "sparse_mode 9 (treeMask) is documented for "
                                "npu_fused_infer_attention_score_v2 only")
            if mask is None:
                raise _fail(op, "sparse_mode 9 needs the tree mask")
            m = mask.cpu()
            blocks = []
            if layout == "TND":
                total = sum(q * q for q in q_lens)
                if m.dim() != 1 or m.shape[0] != total:
                    raise _fail(op, f"TND tree mask must be flat (sum q_i^2,) = ({total},), "
                                    f"got {tuple(mask.shape)}")
                off = 0
                for q in q_lens:
                    blocks.append(m[off: off + q * q].view(q, q))
                    off += q * q
            else:
                if tuple(m.shape) != (B, Q_S, Q_S):
                    raise _fail(op, f"tree mask must be (B, S, S) = ({B}, {Q_S}, {Q_S}), "
                                    f"got {tuple(mask.shape)}")
                if any(q != Q_S for q in q_lens):
                    raise NotImplementedError(f"{op}: treeMask with padded queries is not "
                                              f"documented")
                blocks = [m[b] for b in range(B)]
            for b, (blk, q, L) in enumerate(zip(blocks, q_lens, kv_lens)):
                if q > L:
                    raise _fail(op, f"batch {b}: Q_S={q} > KV_S={L} (treeMask needs Q_S <= KV_S)")
                if bool((blk.diagonal() != 0).any()):
                    raise _fail(op, f"batch {b}: tree mask diagonal must be 0 (a token sees "
                                    f"itself)")
                if bool((blk.triu(1) == 0).logical_and(
                        torch.ones(q, q, dtype=torch.bool).triu(1)).any()):
                    raise _fail(op, f"batch {b}: tree mask must be 1 above the diagonal")
                allowed = torch.ones(q, L, dtype=torch.bool)
                allowed[:, L - q:] = blk == 0          # right-down: the last q KV positions
                out.append(allowed)
            return out
        raise NotImplementedError(f"{op}: sparse_mode {sparse_mode} is not emulated")

    @staticmethod
    def _check_compressed(op: str, mask) -> None:
        if mask is None:
            raise _fail(op, "sparse modes 2/3 need the compressed 2048x2048 causal mask")
        m = mask.cpu()
        while m.dim() > 2 and m.shape[0] == 1:
            m = m[0]
        if tuple(m.shape) != (2048, 2048):
            raise _fail(op, f"sparse modes 2/3 take the compressed (2048, 2048) mask, got "
                            f"{tuple(mask.shape)}")
        if not torch.equal(m != 0, _compressed_causal()):
            raise _fail(op, "the compressed causal mask must be 1 strictly above the "
                            "diagonal and 0 elsewhere")
