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

Beyond the documents, one assumption: ``sparse_mode=9`` through the v2 API, which
the ``tree_sparse`` variant issues. v2's docs list sparse modes 0-4 only, and v1's
document mode 9 ("treeMask") only for MLA, with ``query_rope`` and ``key_rope``; the
tree-mask layout emulated here (``(B, S, S)``, or flat ``(sum q_i^2,)`` in TND,
over the last ``q`` KV positions) is ours, checked on a device only by the
backend's startup probe. ``assume_v2_tree_mask=False`` rejects it like any other
undocumented call.

Not enforced, so tests can use small float32 heads: TND's documented head sizes
and dtype without rope (128 or 192, bfloat16); the backend refuses the rest at
startup (``vllm_treespec.attention.ascend.documented``).

What it cannot tell: whether CANN accepts a combination the docs allow,
bf16/fp16 rounding inside the kernels (everything here is float32 math),
performance, and graph capture.

Supported: layouts TND, BSND, BSH, BNSD; paged KV (``block_table``, block size
128..512 step 128, cache ``(blocks, block, KVH*D)`` or, for TND/BNSD, ``(blocks,
KVH, block, D)``) and dense KV; ``actual_seq_lengths(_kv)`` conventions (TND query
lengths cumulative; paged KV lengths per request; dense TND KV lengths
cumulative; other layouts per request, a single value broadcasts); sparse modes
0, 1, 2, 3 (and 9, assumed) with their mask layouts and alignments; GQA; ``softmax_lse``;
``npu_attention_update``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_treespec.attention.emulation_inputs import (
    INT32_MAX,
    FIAContractError,
    allowed_positions,
    dense_kv,
    int_list,
    lengths_from_cumulative,
    paged_kv,
    per_batch_lengths,
    violation,
)

__all__ = ["EmulatedTorchNPU", "FIAContractError"]

HALF_TYPES = (torch.float16, torch.bfloat16)


class EmulatedTorchNPU:
    """Stand-in for the ``torch_npu`` namespace: the three ops the backend issues.

    ``calls`` logs (op, layout, sparse_mode, lengths, mask shape) of every call.
    ``allow_float32`` admits float32 tensors (the ops take fp16/bf16) so tests can
    compare at tight tolerances. ``assume_v2_tree_mask`` emulates ``sparse_mode=9``
    through v2 as ``tree_sparse`` assumes it behaves (undocumented; see the module
    docstring); False rejects it as the v2 docs do.
    """

    def __init__(self, allow_float32: bool = True, assume_v2_tree_mask: bool = True):
        self.allow_float32 = allow_float32
        self.assume_v2_tree_mask = assume_v2_tree_mask
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
            raise violation(op, f"{sp} lse and {len(local_out)} outputs (need equal counts "
                            f"in [1, 16])")
        if update_type != 0:
            raise NotImplementedError(f"{op}: update_type {update_type} is not emulated")
        M, D = local_out[0].shape if local_out[0].dim() == 2 else (None, None)
        if M is None:
            raise violation(op, f"local outputs must be 2-D [rows, D], got "
                            f"{tuple(local_out[0].shape)}")
        if not (8 <= D <= 512 and D % 8 == 0):
            raise violation(op, f"head dim {D} outside [8, 512] or not a multiple of 8")
        for l_i, o_i in zip(lse, local_out):
            if l_i.dtype != torch.float32 or tuple(l_i.shape) != (M,):
                raise violation(op, f"lse must be float32 [{M}], got {l_i.dtype} "
                                f"{tuple(l_i.shape)}")
            if tuple(o_i.shape) != (M, D) or o_i.dtype != local_out[0].dtype:
                raise violation(op, "local outputs must share shape and dtype")
            if not (l_i.is_contiguous() and o_i.is_contiguous()):
                raise violation(op, "non-contiguous tensors are not supported")
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
        ok = HALF_TYPES + ((torch.float32,) if self.allow_float32 else ())
        if query.dtype not in ok:
            raise violation(op, f"query dtype {query.dtype} (supported: float16, bfloat16)")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise violation(op, f"key/value dtype {key.dtype}/{value.dtype} differs from the "
                            f"query's {query.dtype} (quantised KV is not emulated)")

    def allowed_positions(self, op, v2, layout, mask, sparse_mode, *rest) -> list[torch.Tensor]:
        """Per batch the [q, kv] may-attend matrix the documents give a call (a
        method, so a test can emulate a device that reads a mask differently)."""
        if v2 and sparse_mode == 9 and not self.assume_v2_tree_mask:
            raise violation(op, "sparse_mode 9 is not documented for this op (its docs "
                            "list sparse modes 0-4)")
        return allowed_positions(op, v2, layout, mask, sparse_mode, *rest)

    def _fia(self, op, v2, query, key, value, mask, q_arg, kv_arg, block_table, num_heads,
             num_kv_heads, scale, pre_tokens, next_tokens, layout, sparse_mode,
             inner_precise, block_size, want_lse):
        self._check_dtype(op, query, key, value)
        for name, t in (("query", query), ("key", key), ("value", value),
                        ("atten_mask", mask), ("block_table", block_table)):
            if t is not None and not t.is_contiguous():
                raise violation(op, f"{name} is not contiguous (not supported)")
        if inner_precise not in (0, 1, 2, 3):
            raise violation(op, f"inner_precise {inner_precise} (allowed 0..3)")
        H = int(num_heads)
        KVH = int(num_kv_heads) or H
        if H % KVH or H // KVH > 64:
            raise violation(op, f"num_heads {H} / num_key_value_heads {KVH}: must divide, "
                            f"ratio <= 64")

        # ---- query layout -> per-batch query rows ---------------------------
        q_lens_arg = int_list(q_arg)
        if layout == "TND":
            if query.dim() != 3:
                raise violation(op, f"TND query must be 3-D, got {tuple(query.shape)}")
            Ttok, N, D = query.shape
            q_lens = lengths_from_cumulative(op, "actual_seq_lengths", q_lens_arg)
            if q_lens_arg and q_lens_arg[-1] > Ttok:
                raise violation(op, f"actual_seq_lengths end at {q_lens_arg[-1]} > T={Ttok}")
            B = len(q_lens)
            starts = [0] + q_lens_arg[:-1]
            q_rows = [query[s: s + n] for s, n in zip(starts, q_lens)]    # [n, N, D]
            Q_S = None
        elif layout in ("BSND", "BSH", "BNSD"):
            if layout == "BSH":
                if query.dim() != 3 or query.shape[2] % H:
                    raise violation(op, f"BSH query {tuple(query.shape)} with {H} heads")
                B, Q_S = query.shape[:2]
                q4 = query.view(B, Q_S, H, -1)
            elif layout == "BSND":
                if query.dim() != 4:
                    raise violation(op, f"BSND query must be 4-D, got {tuple(query.shape)}")
                B, Q_S = query.shape[:2]
                q4 = query
            else:
                if query.dim() != 4:
                    raise violation(op, f"BNSD query must be 4-D, got {tuple(query.shape)}")
                B, Q_S = query.shape[0], query.shape[2]
                q4 = query.transpose(1, 2)
            N, D = q4.shape[2], q4.shape[3]
            q_lens = per_batch_lengths(op, "actual_seq_lengths", q_lens_arg, B, Q_S)
            if any(not 0 <= q <= Q_S for q in q_lens):
                raise violation(op, f"actual_seq_lengths {q_lens} exceed the query's S={Q_S}")
            q_rows = [q4[b, : q_lens[b]] for b in range(B)]
        else:
            raise NotImplementedError(f"{op}: input_layout {layout!r} is not emulated")
        if N != H:
            raise violation(op, f"query has {N} heads but num_heads={H}")
        if D % 16 or D > 512:
            raise violation(op, f"head dim {D}: must be a multiple of 16 and <= 512")
        if Q_S == 1 and inner_precise >= 2:
            raise violation(op, "with Q_S == 1 inner_precise must be 0 or 1")

        # ---- KV -------------------------------------------------------------
        kv_lens_arg = int_list(kv_arg)
        if key.shape != value.shape:
            raise violation(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        if block_table is not None:
            k_rows, v_rows, kv_lens, kv_s = paged_kv(op, layout, key, value, block_table,
                                                     kv_lens_arg, block_size, B, KVH, D)
        else:
            k_rows, v_rows, kv_lens, kv_s = dense_kv(op, layout, key, value, kv_lens_arg,
                                                     B, KVH, D)

        # ---- masks ------------------------------------------------------------
        allowed = self.allowed_positions(op, v2, layout, mask, sparse_mode, pre_tokens,
                                         next_tokens, q_lens, kv_lens, B, Q_S, kv_s)

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
