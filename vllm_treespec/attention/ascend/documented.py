"""What torch_npu's op docs cover for the TND calls some fused variants issue.

Source: the ``npu_fused_infer_attention_score`` (FIA, v1) and
``npu_fused_infer_attention_score_v2`` entries of ``torch_npu/_op_plugin_docs.py``
(the same text in torch-npu 2.10.0.post4 and 2.14.0). Without ``query_rope`` /
``key_rope``, v2's TND limits read: "要求Q_D、K_D、V_D等于128，或者Q_D、K_D等于192，
V_D等于128/192" and "数据类型仅支持BFLOAT16". With one head size for Q, K and V (our
case) that is head size 128 or 192, bfloat16 only.

v1's own TND paragraph is narrower still (Q_D = K_D = 192, equal query and KV head
counts), and both pages also say TND does not support page attention while their
page-attention section lists TND. vllm-ascend's stock call (v1, TND, head size 128,
GQA, paged) is outside v1's paragraph, so that paragraph evidently does not describe
the paged GQA path; we follow v2's. None of this has been checked on an NPU here.

The variants whose tree calls are TND without rope: ``two_pass`` (its prefix pass,
v1) and ``tree_sparse`` (v2). ``full_mask`` and the dense pass are BSND, the drafting
levels' prefix pass is BSND too, and ``triton`` issues no torch_npu call. Outside
the documented head sizes and dtype, ``two_pass`` is refused when its buffers are
reserved (vLLM's profiling run, at startup) and ``tree_sparse``'s startup probe
declines (the worker then uses ``full_mask``, as for any failed probe).

What no doc covers, the tree-mask layout of ``sparse_mode=9`` through v2 on GQA, is
left to that probe: v2 lists sparse modes 0-4 only, and v1 documents mode 9
("treeMask") only for MLA, i.e. with ``query_rope`` and ``key_rope``.

Owns :data:`TND_HEAD_SIZES`, :data:`TND_DTYPE`, :data:`TND_VARIANTS`, :func:`tnd_gap`,
:func:`variant_gap` and :func:`check_documented`. Imports :mod:`.constants` (and,
lazily, :mod:`.settings` for the variable's name and :mod:`vllm_treespec.config`).
"""

from __future__ import annotations

import torch

from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE, TRITON, TWO_PASS

TND_HEAD_SIZES = (128, 192)
TND_DTYPE = torch.bfloat16
TND_VARIANTS = (TWO_PASS, TREE_SPARSE)


def tnd_gap(head_size: int, dtype: torch.dtype) -> str | None:
    """What of (head size, dtype) the TND docs do not cover, or None if covered."""
    gaps = []
    if int(head_size) not in TND_HEAD_SIZES:
        gaps.append(f"head size {head_size}")
    if dtype != TND_DTYPE:
        gaps.append(f"dtype {str(dtype).removeprefix('torch.')}")
    return " and ".join(gaps) or None


def variant_gap(variant: str, head_size: int, dtype: torch.dtype) -> str | None:
    """Why ``variant``'s calls are outside torch_npu's docs for these heads, or None."""
    if variant not in TND_VARIANTS:
        return None
    gap = tnd_gap(head_size, dtype)
    if gap is None:
        return None
    return (f"{variant!r} issues torch_npu attention calls in the TND layout without "
            f"rope inputs, which torch_npu's docs cover only for head size "
            f"{' or '.join(map(str, TND_HEAD_SIZES))} and dtype bfloat16; got {gap}")


def check_documented(variant: str, head_size: int, dtype: torch.dtype) -> None:
    """Refuse ``variant`` by name for heads or a dtype its calls' docs exclude."""
    reason = variant_gap(variant, head_size, dtype)
    if reason is None:
        return
    from vllm_treespec.attention.ascend.settings import VARIANT_ENV
    from vllm_treespec.config import TreeSpecConfigError

    raise TreeSpecConfigError(
        f"eagle3_tree: ${VARIANT_ENV}: {reason}. Choose {FULL_MASK!r} (BSND, documented "
        f"for float16 and bfloat16) or {TRITON!r} (our Triton kernel) instead")
