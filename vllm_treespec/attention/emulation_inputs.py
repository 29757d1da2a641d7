"""Inputs of the emulated torch_npu attention ops (see ``emulation``): the
documented argument conventions (length lists, contract errors), paged and
dense KV gathered per request, and the mask each sparse mode implies, as the
positions every query row may attend to (sparse mode 9 on v2 is an assumption,
not documented: see its branch). Pure torch; imports nothing of ours."""

from __future__ import annotations

import torch

INT32_MAX = 2147483647


_COMPRESSED: list[torch.Tensor] = []


def _compressed_causal() -> torch.Tensor:
    if not _COMPRESSED:
        _COMPRESSED.append(torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    return _COMPRESSED[0]


class FIAContractError(ValueError):
    """An argument combination the torch_npu documentation does not allow."""


def violation(op: str, what: str) -> FIAContractError:
    """The error for an argument combination the documents rule out."""
    return FIAContractError(f"{op}: {what}")


def int_list(x) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def per_batch_lengths(op: str, name: str, values: list[int] | None, batch: int,
                      default: int) -> list[int]:
    """Non-TND length lists: None = the shape's S; one value broadcasts; a longer
    list contributes its first ``batch`` entries; anything else is rejected."""
    if values is None:
        return [default] * batch
    if len(values) == 1:
        return values * batch
    if len(values) >= batch:
        return values[:batch]
    raise violation(op, f"{name} has {len(values)} entries for batch {batch} (allowed: 1 "
                    f"or at least the batch size)")


def lengths_from_cumulative(op: str, name: str, values: list[int] | None) -> list[int]:
    if values is None:
        raise violation(op, f"{name} is required with input_layout TND")
    prev = 0
    for v in values:
        if v < prev:
            raise violation(op, f"{name} must be cumulative (non-decreasing, >= 0) in TND: "
                            f"{values}")
        prev = v
    return [b - a for a, b in zip([0] + values[:-1], values)]


# ---- KV -------------------------------------------------------------------------
def paged_kv(op, layout, key, value, table, kv_arg, block_size, B, KVH, D):
    if table.dtype != torch.int32 or table.dim() != 2:
        raise violation(op, f"block_table must be 2-D int32, got {table.dtype} "
                        f"{tuple(table.shape)}")
    if table.shape[0] != B:
        raise violation(op, f"block_table has {table.shape[0]} rows for batch {B}")
    if block_size not in (128, 256, 384, 512):
        raise violation(op, f"block_size {block_size} (page attention: 128..512, multiple "
                        f"of 128)")
    if key.dim() == 3:
        nb, bs, hd = key.shape
        if hd != KVH * D:
            raise violation(op, f"paged key (blocks, block, H) has H={hd}, expected "
                            f"num_key_value_heads*D={KVH * D}")
        k_blocks = key.view(nb, bs, KVH, D)
        v_blocks = value.view(nb, bs, KVH, D)
    elif key.dim() == 4 and layout in ("TND", "BNSD"):
        nb, kvh, bs, d = key.shape
        if (kvh, d) != (KVH, D):
            raise violation(op, f"paged key (blocks, KVH, block, D) {tuple(key.shape)}")
        k_blocks = key.transpose(1, 2)
        v_blocks = value.transpose(1, 2)
    else:
        raise violation(op, f"paged key {tuple(key.shape)} with layout {layout}: BSH/BSND "
                        f"take (blocks, block, KVH*D) only")
    if bs != block_size:
        raise violation(op, f"cache blocks hold {bs} tokens but block_size={block_size}")
    if kv_arg is None:
        raise violation(op, "page attention requires actual_seq_lengths_kv")
    kv_lens = per_batch_lengths(op, "actual_seq_lengths_kv", kv_arg, B, 0)
    cap = table.shape[1] * bs
    for b, L in enumerate(kv_lens):
        if not 0 <= L <= cap:
            raise violation(op, f"KV length {L} of batch {b} exceeds the block table's "
                            f"{cap} slots (paged KV lengths are per request)")
    # A user mask must cover at least max-blocks-per-sequence * block_size columns.
    need = -(-max(kv_lens, default=0) // bs) * bs
    k_rows, v_rows = [], []
    tbl = table.cpu()
    for b, L in enumerate(kv_lens):
        pos = torch.arange(L)
        blocks = tbl[b, pos // bs].long()
        if L and bool(((blocks < 0) | (blocks >= nb)).any()):
            raise violation(op, f"block_table row {b} references a block outside the "
                            f"{nb}-block cache")
        k_rows.append(k_blocks[blocks.to(key.device), (pos % bs).to(key.device)])
        v_rows.append(v_blocks[blocks.to(key.device), (pos % bs).to(key.device)])
    return k_rows, v_rows, kv_lens, need


def dense_kv(op, layout, key, value, kv_arg, B, KVH, D):
    if layout == "TND":
        if key.dim() != 3 or tuple(key.shape[1:]) != (KVH, D):
            raise violation(op, f"TND key must be (T, KVH, D), got {tuple(key.shape)}")
        kv_lens = lengths_from_cumulative(op, "actual_seq_lengths_kv", kv_arg)
        if len(kv_lens) != B:
            raise violation(op, f"{len(kv_lens)} KV lengths for batch {B}")
        starts = [0] + kv_arg[:-1]
        if kv_arg and kv_arg[-1] > key.shape[0]:
            raise violation(op, f"actual_seq_lengths_kv ends at {kv_arg[-1]} > "
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
        raise violation(op, f"dense {layout} key {tuple(key.shape)} for batch {B}, "
                        f"{KVH} KV heads, D={D}")
    S = k4.shape[1]
    kv_lens = per_batch_lengths(op, "actual_seq_lengths_kv", kv_arg, B, S)
    if any(not 0 <= L <= S for L in kv_lens):
        raise violation(op, f"actual_seq_lengths_kv {kv_lens} exceed the key's S={S}")
    return ([k4[b, :L] for b, L in enumerate(kv_lens)],
            [v4[b, :L] for b, L in enumerate(kv_lens)], kv_lens, S)


# ---- masks ----------------------------------------------------------------------
def allowed_positions(op, v2, layout, mask, sparse_mode, pre_tokens, next_tokens, q_lens,
                      kv_lens, B, Q_S, kv_s) -> list[torch.Tensor]:
    """Per batch a bool [q_b, kv_b] may-attend matrix."""
    if mask is not None and mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise violation(op, f"atten_mask dtype {mask.dtype} (bool, int8 or uint8)")
    if layout == "TND":
        # The docs' TND limits: "sparse模式仅支持sparse=0且不传mask，或sparse=3且传入mask",
        # then "sparse模式支持sparse_mode=4且传入mask" (4 is not emulated, below).
        # (9, mask) on v2 is the tree_sparse assumption (see the sparse_mode 9 branch).
        allowed_modes = {(0, False), (3, True), (4, True)} | ({(9, True)} if v2 else set())
        if (sparse_mode, mask is not None) not in allowed_modes:
            raise violation(op, f"TND allows sparse_mode 0 without a mask or 3/4 with the "
                            f"compressed mask{' (or 9 with a flat tree mask)' if v2 else ''}; "
                            f"got sparse_mode={sparse_mode} with"
                            f"{'' if mask is not None else 'out'} a mask")
    out = []
    if sparse_mode in (0, 1):
        if mask is None:
            if sparse_mode == 1:
                raise violation(op, "sparse_mode 1 (allMask) needs the full atten_mask")
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
            raise violation(op, f"atten_mask {tuple(mask.shape)}: expected (Q_S, KV_S), "
                            f"(B|1, Q_S, KV_S) or (B|1, 1, Q_S, KV_S) with B={B}")
        need_rows = Q_S if Q_S is not None else max(q_lens)
        need_cols = kv_s if kv_s is not None else max(kv_lens)
        if m.shape[-1] < need_cols:
            raise violation(op, f"atten_mask covers {m.shape[-1]} KV positions; the KV "
                            f"side needs {need_cols} (page attention: at least "
                            f"max blocks per sequence * block_size)")
        if m.shape[-2] < need_rows:
            raise violation(op, f"atten_mask has {m.shape[-2]} query rows, the query "
                            f"has S={need_rows}")
        for b in range(B):
            mb = m[b if m.shape[0] == B else 0, 0]
            out.append(mb[: q_lens[b], : kv_lens[b]] == 0)
        return out
    if sparse_mode in (2, 3):
        check_compressed(op, mask)
        for q, L in zip(q_lens, kv_lens):
            i = torch.arange(q).unsqueeze(1)
            j = torch.arange(L).unsqueeze(0)
            out.append(j <= i + (L - q if sparse_mode == 3 else 0))
        return out
    if sparse_mode == 9:
        # Documented only for v1 and only for MLA: "sparse_mode为9时, 代表treeMask模式 ...
        # 仅MLA场景(query_rope和key_rope不为空)支持", and rope inputs are not emulated.
        # v2's docs list modes 0-4 ("参数sparse_mode当前仅支持值为0、1、2、3、4的场景,
        # 取其它值时会报错"). What follows for v2 is not documented anywhere: it is the
        # layout the tree_sparse variant assumes (EmulatedTorchNPU can refuse it,
        # ``assume_v2_tree_mask=False``), which the startup probe checks on a device.
        if not v2:
            raise violation(op, "sparse_mode 9 (treeMask) is documented for this op only "
                            "for MLA, with query_rope and key_rope (not emulated)")
        if mask is None:
            raise violation(op, "sparse_mode 9 needs the tree mask")
        m = mask.cpu()
        blocks = []
        if layout == "TND":
            total = sum(q * q for q in q_lens)
            if m.dim() != 1 or m.shape[0] != total:
                raise violation(op, f"TND tree mask must be flat (sum q_i^2,) = ({total},), "
                                f"got {tuple(mask.shape)}")
            off = 0
            for q in q_lens:
                blocks.append(m[off: off + q * q].view(q, q))
                off += q * q
        else:
            if tuple(m.shape) != (B, Q_S, Q_S):
                raise violation(op, f"tree mask must be (B, S, S) = ({B}, {Q_S}, {Q_S}), "
                                f"got {tuple(mask.shape)}")
            if any(q != Q_S for q in q_lens):
                raise NotImplementedError(f"{op}: treeMask with padded queries is not "
                                          f"documented")
            blocks = [m[b] for b in range(B)]
        for b, (blk, q, L) in enumerate(zip(blocks, q_lens, kv_lens)):
            if q > L:
                raise violation(op, f"batch {b}: Q_S={q} > KV_S={L} (treeMask needs Q_S <= KV_S)")
            if bool((blk.diagonal() != 0).any()):
                raise violation(op, f"batch {b}: tree mask diagonal must be 0 (a token sees "
                                f"itself)")
            if bool((blk.triu(1) == 0).logical_and(
                    torch.ones(q, q, dtype=torch.bool).triu(1)).any()):
                raise violation(op, f"batch {b}: tree mask must be 1 above the diagonal")
            allowed = torch.ones(q, L, dtype=torch.bool)
            allowed[:, L - q:] = blk == 0          # right-down: the last q KV positions
            out.append(allowed)
        return out
    raise NotImplementedError(f"{op}: sparse_mode {sparse_mode} is not emulated")


def check_compressed(op: str, mask) -> None:
    if mask is None:
        raise violation(op, "sparse modes 2/3 need the compressed 2048x2048 causal mask")
    m = mask.cpu()
    while m.dim() > 2 and m.shape[0] == 1:
        m = m[0]
    if tuple(m.shape) != (2048, 2048):
        raise violation(op, f"sparse modes 2/3 take the compressed (2048, 2048) mask, got "
                        f"{tuple(mask.shape)}")
    if not torch.equal(m != 0, _compressed_causal()):
        raise violation(op, "the compressed causal mask must be 1 strictly above the "
                        "diagonal and 0 elsewhere")
