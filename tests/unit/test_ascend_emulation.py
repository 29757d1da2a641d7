"""The Ascend tree-attention calls, run through a CPU emulation of torch_npu's contract.

Every test builds the exact argument tuples the NPU backend issues
(``vllm_treespec.attention.ascend``) and runs them through
``vllm_treespec.attention.emulation.EmulatedTorchNPU``, which follows the torch_npu
documentation. What this cannot show (CANN accepting the calls, bf16 kernel
numerics, graph capture, speed) is checked on hardware by ``tests/npu`` and
``vllm-treespec npu-check``.
"""

import subprocess
import sys

import pytest
import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.calls import (
    ATTENTION_UPDATE,
    FIA_V2,
    OpCall,
    causal_paged_call,
    compressed_causal_mask,
    full_mask_call,
    prefix_call,
    tree_sparse_call,
)
from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE, TWO_PASS, VARIANTS
from vllm_treespec.attention.ascend.execute import run_draft_level, run_tree_verify
from vllm_treespec.attention.ascend.graphs import capture_issuer, update_captured
from vllm_treespec.attention.ascend.plans import (
    check_plan_invariants,
    pad_plan,
    plan_tree_rows,
    plan_uniform_batch,
)
from vllm_treespec.attention.ascend.settings import (
    EXEC_MODE_ENV,
    FULL_GRAPH_ENV,
    VARIANT_ENV,
    resolve_settings,
)
from vllm_treespec.attention.ascend.synthetic import (
    buffers_for,
    make_verify_batch,
    probe_tree_sparse,
    verify_with,
)
from vllm_treespec.attention.emulation import EmulatedTorchNPU, FIAContractError
from vllm_treespec.attention.metadata import DraftTreeLevelMetadata
from vllm_treespec.attention.reference import prefix_side_attention

KINDS = [
    ["tree", "causal", "chain", "tree", "causal"],   # mixed prefill / decode / trees
    ["causal", "tree", "tree", "tree"],
    ["tree"],
]
HEADS = [(4, 2, 16), (6, 1, 32), (2, 2, 16)]          # GQA 2:1, MQA 6:1, MHA


@pytest.fixture
def ops():
    return EmulatedTorchNPU()


def _err(a, b):
    return float((a.float() - b.float()).abs().max())


# ------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", range(3))
def test_variants_match_reference_on_mixed_batches(ops, variant, case):
    H, KVH, D = HEADS[case]
    batch = make_verify_batch(case, KINDS[case], tree_size=9, num_heads=H,
                              num_kv_heads=KVH, head_size=D)
    out = verify_with(ops, variant, batch)
    assert _err(out, batch.reference_output()) < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_uniform_batch_runs_without_copies(ops, variant):
    # Every request has T query tokens back to back: the shape graphs capture.
    batch = make_verify_batch(11, ["tree", "tree", "chain"], 7, 4, 2, 16, full_trees=True)
    plan = plan_tree_rows(batch.tree_rows)
    assert plan.uniform
    buffers = buffers_for(batch, plan)
    out = verify_with(ops, variant, batch, buffers)
    assert _err(out, batch.reference_output()) < 1e-5
    # The flat rows are viewed as BSND: no padded copy of q, k or v was made.
    assert not {"q_pad", "k_pad", "v_pad"} & set(buffers._tensors), set(buffers._tensors)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bfloat16(variant):
    ops = EmulatedTorchNPU(allow_float32=False)
    batch = make_verify_batch(5, ["tree", "causal", "tree"], 9, 4, 2, 16,
                              dtype=torch.bfloat16)
    out = verify_with(ops, variant, batch)
    assert out.dtype == torch.bfloat16
    assert _err(out, batch.reference_output()) < 3e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_chain_tree_equals_todays_sparse_mode_3_call(ops, variant):
    batch = make_verify_batch(3, ["chain", "chain", "causal"], 8, 4, 2, 16)
    h = batch.heads
    stock, _ = causal_paged_call(batch.query, batch.key_cache, batch.value_cache,
                                 batch.block_table, batch.cu_q_lens, batch.kv_lens,
                                 compressed_causal_mask("cpu"), h.num_heads,
                                 h.num_kv_heads, h.scale)(ops)
    out = torch.full_like(batch.query, float("nan"))
    plan = plan_tree_rows(batch.tree_rows)
    run_tree_verify(ops, variant, plan, buffers_for(batch, plan), batch.query,
                    batch.key, batch.value, batch.key_cache, batch.value_cache, h, out)
    rows = plan.rows
    assert _err(out[rows], stock[rows]) < 1e-5


def test_issued_calls_are_the_documented_ones(ops):
    batch = make_verify_batch(2, ["tree", "causal", "tree"], 9, 4, 2, 16)
    plan = plan_tree_rows(batch.tree_rows)
    buffers = buffers_for(batch, plan)
    for variant in VARIANTS:
        run_tree_verify(ops, variant, plan, buffers, batch.query, batch.key, batch.value,
                        batch.key_cache, batch.value_cache, batch.heads,
                        torch.empty_like(batch.query))
    fia = [c for c in ops.calls if c["op"].startswith("npu_fused")]
    a, b_prefix, b_tree, c = fia
    assert (a["layout"], a["sparse_mode"], a["paged"]) == ("BSND", 0, True)
    assert a["mask_shape"] == (2, 1, 9, batch.block_table.shape[1] * 128)
    assert a["q_lens"] == plan.q_lens and a["kv_lens"] == plan.kv_lens  # per request
    assert (b_prefix["layout"], b_prefix["sparse_mode"], b_prefix["mask_shape"]) == ("TND", 0, None)
    assert b_prefix["kv_lens"] == plan.ctx_lens
    assert (b_tree["layout"], b_tree["paged"]) == ("BSND", False)
    assert b_tree["mask_shape"] == (2, 1, 9, 9)
    assert (c["op"], c["layout"], c["sparse_mode"]) == (FIA_V2, "TND", 9)
    assert c["mask_shape"] == (sum(q * q for q in plan.q_lens),)
    assert [x["op"] for x in ops.calls].count(ATTENTION_UPDATE) == 1


# ------------------------------------------------------------- persistent mask
def test_full_mask_buffer_rewrites_only_tree_windows(ops):
    # Several steps through one buffer, with requests of changing context and
    # batch composition: the buffer must always equal a freshly built mask on
    # every column FIA reads, and stay 0 everywhere outside the current windows.
    buffers = None
    for step, kinds in enumerate([["tree", "tree", "tree"], ["tree"], ["tree", "chain"],
                                  ["chain", "tree", "tree"]]):
        batch = make_verify_batch(40 + step, kinds, 6, 2, 1, 16, max_ctx=400)
        plan = plan_tree_rows(batch.tree_rows)
        if buffers is None:
            buffers = TreeAttentionBuffers(4, 6, 2, 1, 16, torch.float32, "cpu", 8)
        table = torch.zeros(plan.batch_size, 8, dtype=torch.int32)
        table[:, : batch.block_table.shape[1]] = plan.block_table
        plan.block_table = table
        mask = buffers.full_mask(plan)
        for b in range(plan.batch_size):
            ctx, q = plan.ctx_lens[b], plan.q_lens[b]
            expect = torch.zeros(6, 8 * 128, dtype=torch.int8)
            expect[:, ctx: ctx + q] = (~plan.intra_mask[b, :, :q]).to(torch.int8)
            got = mask[b, 0].clone()
            # columns past ctx+q are beyond the KV length (ignored by FIA); the
            # window's spill-over there repeats the last node
            got[:, ctx + q:] = 0
            assert torch.equal(got, expect), f"step {step} request {b}"
            assert not bool(mask[b, 0, :, ctx + 6:].any())
        out = torch.empty_like(batch.query)
        run_tree_verify(ops, FULL_MASK, plan, buffers, batch.query, None, None,
                        batch.key_cache, batch.value_cache, batch.heads, out)
        ref = batch.reference_output()
        assert _err(out[plan.rows], ref[plan.rows]) < 1e-5


def test_masks_written_once_per_step(ops):
    batch = make_verify_batch(8, ["tree", "tree"], 7, 2, 2, 16)
    plan = plan_tree_rows(batch.tree_rows)
    buffers = buffers_for(batch, plan)
    first = buffers.full_mask(plan)
    first.fill_(7)  # a second layer must not rewrite it (same step)
    assert int(buffers.full_mask(plan).max()) == 7


# ------------------------------------------------------------------ draft levels
def test_draft_level_matches_prefix_side_reference(ops):
    batch = make_verify_batch(9, ["causal", "causal", "causal"], 4, 4, 2, 16)
    B, F, cap, H, KVH, D = 3, 3, 8, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    prefix = torch.tensor([max(1, kv - 2) for kv in batch.kv_lens])
    side_k = torch.randn(B, cap, KVH, D, generator=gen)
    side_v = torch.randn(B, cap, KVH, D, generator=gen)
    offset = 3
    side_mask = torch.rand(B, F, offset + F, generator=gen) < 0.5
    side_mask[:, :, offset:] = torch.eye(F, dtype=torch.bool)
    md = DraftTreeLevelMetadata(batch_size=B, width=F, side_offset=offset, side_capacity=cap,
                                prefix_len=prefix, max_prefix_len=int(prefix.max()),
                                block_table=batch.block_table, block_size=128,
                                side_mask=side_mask)
    q = torch.randn(B, F, H, D, generator=gen)
    out = run_draft_level(ops, md, q, side_k, side_v, batch.key_cache, batch.value_cache,
                          batch.heads)
    hi = offset + F
    ref = prefix_side_attention(q, batch.key_cache, batch.value_cache,
                                batch.block_table, 128, prefix, side_k[:, :hi],
                                side_v[:, :hi], side_mask, batch.heads.scale)
    assert out.shape == (B, F, H, D)
    assert _err(out, ref) < 1e-5
    # Both passes BSND: TND without rope is documented for bf16 at head size 128/192 only.
    assert [c["layout"] for c in ops.calls if c["op"].startswith("npu_fused")] == [
        "BSND", "BSND"]


# ------------------------------------------------------- wrong arguments are caught
def _a_call(batch):
    plan = plan_tree_rows(batch.tree_rows)
    buffers = buffers_for(batch, plan)
    q = torch.index_select(batch.query, 0, plan.token_index.reshape(-1)).view(
        plan.batch_size, plan.tree_size, batch.heads.num_heads, -1)
    h = batch.heads
    return plan, full_mask_call(plan, buffers, q, batch.key_cache, batch.value_cache,
                                h.num_heads, h.num_kv_heads, h.scale)


def _c_call(batch):
    """tree_sparse's one FIA v2 call (sparse_mode 9) for ``batch``'s tree rows."""
    plan = plan_tree_rows(batch.tree_rows)
    h = batch.heads
    return tree_sparse_call(plan, buffers_for(batch, plan),
                            batch.query.index_select(0, plan.rows), batch.key_cache,
                            batch.value_cache, h.num_heads, h.num_kv_heads, h.scale)


def _a_rows(plan, out):
    return out[plan.valid]


@pytest.fixture
def tree_batch():
    return make_verify_batch(21, ["tree", "tree", "chain"], 9, 4, 2, 16)


def test_correct_full_mask_call_matches(ops, tree_batch):
    plan, call = _a_call(tree_batch)
    out, _ = call(ops)
    ref = tree_batch.reference_output()
    assert _err(_a_rows(plan, out), ref[plan.rows]) < 1e-5


def test_inverted_mask_polarity_is_detected(ops, tree_batch):
    plan, call = _a_call(tree_batch)
    wrong = call.with_kwargs(atten_mask=(1 - call.kwargs["atten_mask"]).contiguous())
    out, _ = wrong(ops)
    ref = tree_batch.reference_output()
    diff = (_a_rows(plan, out).float() - ref[plan.rows]).abs()
    assert bool(torch.isnan(diff).any()) or float(diff.max()) > 0.1


def test_intra_tree_mask_layout_with_paged_kv_is_rejected(ops, tree_batch):
    plan, call = _a_call(tree_batch)
    small = (~plan.intra_mask).to(torch.int8).unsqueeze(1).contiguous()  # (B, 1, T, T)
    with pytest.raises(FIAContractError, match="KV positions"):
        call.with_kwargs(atten_mask=small)(ops)


def test_transposed_full_mask_is_rejected(ops, tree_batch):
    _, call = _a_call(tree_batch)
    with pytest.raises(FIAContractError):
        call.with_kwargs(atten_mask=call.kwargs["atten_mask"].transpose(2, 3).contiguous())(ops)


def test_sparse_mode_3_with_a_tree_mask_is_rejected(ops, tree_batch):
    _, call = _a_call(tree_batch)
    with pytest.raises(FIAContractError, match="compressed"):
        call.with_kwargs(sparse_mode=3)(ops)


def test_sparse_mode_9_on_the_v1_api_is_rejected(ops, tree_batch):
    # v1 documents treeMask only for MLA (query_rope and key_rope given).
    _, call = _a_call(tree_batch)
    with pytest.raises(FIAContractError, match="only for MLA, with query_rope and key_rope"):
        call.with_kwargs(sparse_mode=9)(ops)


def test_sparse_mode_9_on_v2_is_an_assumption_the_emulation_can_refuse(tree_batch):
    # v2's docs list sparse modes 0-4: tree_sparse's call is emulated only as assumed.
    call = _c_call(tree_batch)
    call(EmulatedTorchNPU())
    with pytest.raises(FIAContractError, match="modes 0-4"):
        call(EmulatedTorchNPU(assume_v2_tree_mask=False))


def test_tnd_with_a_user_mask_and_sparse_0_is_rejected(ops, tree_batch):
    plan = plan_tree_rows(tree_batch.tree_rows)
    h = tree_batch.heads
    call = prefix_call(tree_batch.query.index_select(0, plan.rows), tree_batch.key_cache,
                       tree_batch.value_cache, plan.block_table, plan.cu_q_lens,
                       plan.kv_lens, h.num_heads, h.num_kv_heads, h.scale)
    with pytest.raises(FIAContractError, match="TND allows"):
        call.with_kwargs(atten_mask=TreeAttentionBuffers(
            3, 9, 4, 2, 16, torch.float32, "cpu", plan.block_table.shape[1]).full_mask(plan))(ops)


def test_inverted_tree_sparse_mask_is_rejected(ops, tree_batch):
    call = _c_call(tree_batch)
    with pytest.raises(FIAContractError, match="diagonal"):
        call.with_kwargs(atten_mask=(1 - call.kwargs["atten_mask"]).contiguous())(ops)


def test_cumulative_kv_lengths_with_paged_kv_are_detected(ops, tree_batch):
    # The classic mix-up: TND query lengths are cumulative, paged KV lengths are not.
    b = tree_batch
    h = b.heads
    import itertools
    call = causal_paged_call(b.query, b.key_cache, b.value_cache, b.block_table,
                             b.cu_q_lens, list(itertools.accumulate(b.kv_lens)),
                             compressed_causal_mask("cpu"), h.num_heads,
                             h.num_kv_heads, h.scale)
    try:
        out, _ = call(ops)
    except FIAContractError:
        return
    assert _err(out, b.reference_output()) > 0.1


def test_non_contiguous_query_is_rejected(ops, tree_batch):
    plan, call = _a_call(tree_batch)
    q = call.args[0]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(FIAContractError, match="contiguous"):
        OpCall(call.op, (strided,) + call.args[1:], call.kwargs)(ops)


def test_swapped_merge_inputs_are_detected(ops, tree_batch):
    # Pair each pass's output with the other pass's lse: the merge must go wrong.
    class Swapping(EmulatedTorchNPU):
        def npu_attention_update(self, lse, local_out, update_type):
            return super().npu_attention_update(list(lse)[::-1], local_out, update_type)

    out = verify_with(Swapping(), TWO_PASS, tree_batch)
    assert _err(out, tree_batch.reference_output()) > 1e-2


def test_wrong_block_size_is_rejected(ops, tree_batch):
    _, call = _a_call(tree_batch)
    with pytest.raises(FIAContractError, match="block"):
        call.with_kwargs(block_size=64)(ops)


# --------------------------------------------------------------------- contract
def test_padding_rows_are_poisoned_and_dead_rows_follow_inner_precise(ops):
    # What the docs leave open is emulated so that relying on it shows up.
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 4, 2, 16)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.int8)
    mask[0, 0, 1] = 1                                  # row 1 sees nothing
    kw = dict(atten_mask=mask, actual_seq_lengths=[3], actual_seq_lengths_kv=[4],
              num_heads=2, input_layout="BSND", sparse_mode=0)
    out, _ = ops.npu_fused_infer_attention_score(q, k, k, inner_precise=0, **kw)
    assert bool(torch.isnan(out[0, 3]).all())          # padding row
    assert bool(torch.isnan(out[0, 1]).all())          # dead row, no correction
    out, _ = ops.npu_fused_infer_attention_score(q, k, k, inner_precise=2, **kw)
    assert bool((out[0, 1] == 0).all())                # dead row, corrected
    assert bool(torch.isfinite(out[0, [0, 2]]).all())


def test_attention_update_merges_split_attention(ops):
    # Attention over keys [0, 10) equals the LSE merge of [0, 4) and [4, 10).
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 16, generator=gen)
    k = torch.randn(10, 2, 16, generator=gen)
    v = torch.randn(10, 2, 16, generator=gen)
    kw = dict(num_heads=2, input_layout="TND", sparse_mode=0, softmax_lse_flag=True,
              actual_seq_lengths=[5])
    whole, _ = ops.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[10], **kw)
    o1, l1 = ops.npu_fused_infer_attention_score(q, k[:4].contiguous(), v[:4].contiguous(),
                                                  actual_seq_lengths_kv=[4], **kw)
    o2, l2 = ops.npu_fused_infer_attention_score(q, k[4:].contiguous(), v[4:].contiguous(),
                                                  actual_seq_lengths_kv=[6], **kw)
    merged, _ = ops.npu_attention_update([l1.reshape(-1), l2.reshape(-1)],
                                         [o1.reshape(10, 16), o2.reshape(10, 16)], 0)
    assert _err(merged.view(5, 2, 16), whole) < 1e-5


def test_plan_invariants(tree_batch):
    plan = plan_tree_rows(tree_batch.tree_rows)
    check_plan_invariants(plan, num_blocks=tree_batch.key_cache.shape[0])
    # pad nodes see only the root
    for b, q in enumerate(plan.q_lens):
        if q < plan.tree_size:
            assert bool(plan.intra_mask[b, q:, 0].all())
            assert not bool(plan.intra_mask[b, q:, 1:].any())
    plan.intra_mask[0, 0, 1] = True   # a root that sees its child
    with pytest.raises(ValueError, match="later token"):
        check_plan_invariants(plan)


def test_probe_falls_back_with_a_reason(ops):
    class NoTreeMask(EmulatedTorchNPU):
        def npu_fused_infer_attention_score_v2(self, *a, **kw):
            raise RuntimeError("sparse_mode 9 not supported by this CANN")

    # Head size 128 in bfloat16: where tree_sparse's TND call is documented, so the
    # probe runs (elsewhere it declines unrun: test_ascend_checks).
    bf16 = torch.bfloat16
    assert probe_tree_sparse(ops, "cpu", bf16, 4, 2, 128, 9).ok
    bad = probe_tree_sparse(NoTreeMask(), "cpu", bf16, 4, 2, 128, 9)
    assert not bad.ok and "not supported" in bad.reason

    class WrongAlignment(EmulatedTorchNPU):    # a device that aligns the tree top-left
        def allowed_positions(self, op, v2, layout, mask, sparse_mode, *rest):
            out = super().allowed_positions(op, v2, layout, mask, sparse_mode, *rest)
            if sparse_mode == 9:
                out = [torch.roll(m, -(m.shape[1] - m.shape[0]), 1) for m in out]
            return out

    off = probe_tree_sparse(WrongAlignment(), "cpu", bf16, 4, 2, 128, 9)
    assert not off.ok and "differs" in off.reason


def test_modules_do_not_import_torch_npu():
    code = ("import sys; import vllm_treespec.attention.ascend.synthetic, "
            "vllm_treespec.attention.ascend.graphs, vllm_treespec.attention.ascend.settings, "
            "vllm_treespec.vllm_glue.ascend, vllm_treespec.vllm_glue.ascend.checks, "
            "vllm_treespec.attention.emulation, vllm_treespec.commands.npu_check, "
            "vllm_treespec.commands.npu_e2e; "
            "assert 'torch_npu' not in sys.modules and 'vllm_ascend' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------- static shapes and graphs
@pytest.mark.parametrize("variant", VARIANTS)
def test_plans_padded_to_the_static_tree_size(ops, variant):
    batch = make_verify_batch(31, ["tree", "causal", "tree"], 6, 4, 2, 16)
    plan = pad_plan(plan_tree_rows(batch.tree_rows), 10)   # runner T=6, buffers T=10
    assert plan.tree_size == 10 and not plan.uniform
    check_plan_invariants(plan)
    buffers = TreeAttentionBuffers(4, 10, 4, 2, 16, torch.float32, "cpu",
                                   batch.block_table.shape[1])
    out = batch.reference_output().clone()
    out[plan.rows] = float("nan")
    run_tree_verify(ops, variant, plan, buffers, batch.query, batch.key, batch.value,
                    batch.key_cache, batch.value_cache, batch.heads, out)
    assert _err(out, batch.reference_output()) < 1e-5


def test_uniform_batch_plan_places_trees_and_tolerates_dummy_requests(ops):
    batch = make_verify_batch(32, ["tree", "tree"], 5, 2, 1, 16, full_trees=True)
    T = 5
    # graph padding: a third, dummy request with KV length 0 and an empty table row
    table = torch.cat([batch.block_table, torch.zeros_like(batch.block_table[:1])])
    plan = plan_uniform_batch(T, batch.kv_lens + [0], table, 128, batch.tree_rows)
    assert plan.kv_lens[-1] == T and plan.ctx_lens[-1] == 0
    ref_plan = plan_tree_rows(batch.tree_rows)
    assert torch.equal(plan.intra_mask[:2], ref_plan.intra_mask)
    assert torch.equal(plan.intra_mask[2], torch.ones(T, T, dtype=torch.bool).tril())
    q = torch.cat([batch.query, torch.zeros(T, 2, 16)])
    out = torch.zeros_like(q)
    buffers = TreeAttentionBuffers(3, T, 2, 1, 16, torch.float32, "cpu", table.shape[1])
    run_tree_verify(ops, FULL_MASK, plan, buffers, q, None, None, batch.key_cache,
                    batch.value_cache, batch.heads, out)
    ref = batch.reference_output()
    assert _err(out[: ref.shape[0]], ref) < 1e-5


class _OutVariant:
    """An emulated op with torch_npu's ``.out`` form (writes into ``out``)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def out(self, *args, workspace=None, out=None, **kwargs):
        assert workspace is not None
        o, lse = self.fn(*args, **kwargs)
        out[0].copy_(o)
        if lse.numel() == out[1].numel():
            out[1].copy_(lse.view_as(out[1]))
        return out


class _FakeGraphDevice:
    """Just enough of torch_npu / torch.npu to drive capture_issuer and
    update_captured on the CPU: the protocol calls are recorded, not executed."""

    def __init__(self):
        emu = EmulatedTorchNPU()
        self.log = []
        self.npu_fused_infer_attention_score = _OutVariant(emu.npu_fused_infer_attention_score)
        self.npu_fused_infer_attention_score_v2 = _OutVariant(
            emu.npu_fused_infer_attention_score_v2)
        self.npu_attention_update = emu.npu_attention_update
        self._npu_fused_infer_attention_score_get_max_workspace = lambda *a, **k: torch.empty(1)
        self._npu_fused_infer_attention_score_v2_get_max_workspace = lambda *a, **k: torch.empty(1)
        dev = self

        class _Event:
            def wait(self, stream): dev.log.append("wait")
            def reset(self, stream): pass
            def record(self, stream): dev.log.append("record")

        class _Npu:
            ExternalEvent = _Event
            @staticmethod
            def current_stream(): return None
            @staticmethod
            def graph_task_group_begin(stream): dev.log.append("group_begin")
            @staticmethod
            def graph_task_group_end(stream): return object()
            @staticmethod
            def graph_task_update_begin(stream, handle): dev.log.append("update_begin")
            @staticmethod
            def graph_task_update_end(stream): dev.log.append("update_end")
            @staticmethod
            def stream(s):
                import contextlib
                return contextlib.nullcontext()

        self.npu = _Npu


@pytest.mark.parametrize("variant", [FULL_MASK, TREE_SPARSE])
def test_captured_calls_are_reissued_with_each_steps_lengths_and_masks(variant):
    # Capture once with placeholder lengths and no trees; each "replay" must then
    # compute the new step's trees over its new KV lengths.
    dev = _FakeGraphDevice()
    T, B = 6, 3
    steps = [make_verify_batch(60 + s, ["tree"] * B, T, 4, 2, 16, full_trees=True,
                               max_ctx=250) for s in range(3)]
    width = max(s.block_table.shape[1] for s in steps)
    nb = max(s.key_cache.shape[0] for s in steps)
    kc, vc = torch.zeros(nb, 128, 2, 16), torch.zeros(nb, 128, 2, 16)
    q, table = torch.zeros(B * T, 4, 16), torch.zeros(B, width, dtype=torch.int32)
    out = torch.zeros_like(q)
    buffers = TreeAttentionBuffers(B, T, 4, 2, 16, torch.float32, "cpu", width)
    capture_plan = plan_uniform_batch(T, [1] * B, table, 128)
    buffers.mark_written(capture_plan)
    records = []
    run_tree_verify(dev, variant, capture_plan, buffers, q, None, None, kc, vc,
                    steps[0].heads, out, issue=capture_issuer(dev, dev.npu, records))
    assert len(records) == 1 and dev.log == ["wait", "group_begin"]
    for batch in steps:
        kc.zero_(); vc.zero_(); table.zero_()
        kc[: batch.key_cache.shape[0]] = batch.key_cache
        vc[: batch.value_cache.shape[0]] = batch.value_cache
        table[:, : batch.block_table.shape[1]] = batch.block_table
        q.copy_(batch.query)
        plan = plan_uniform_batch(T, batch.kv_lens, table, 128, batch.tree_rows)
        update_captured(dev, dev.npu, records, plan, buffers, variant, None, table)
        got = records[0].outs[0].reshape(B * T, 4, 16)
        assert _err(got, batch.reference_output()) < 1e-5
    assert dev.log[-3:] == ["update_begin", "update_end", "record"]


def test_settings_from_config_and_environment():
    from vllm_treespec.config import TreeSpecConfigError

    s = resolve_settings("fused", {})
    assert (s.exec_mode, s.variant, s.full_graph) == ("fused", FULL_MASK, False)
    s = resolve_settings("fused", {EXEC_MODE_ENV: "reference", VARIANT_ENV: "two_pass",
                                   FULL_GRAPH_ENV: "1"})
    assert (s.exec_mode, s.variant, s.full_graph) == ("reference", TWO_PASS, True)
    for env in ({EXEC_MODE_ENV: "fast"}, {VARIANT_ENV: "sparse9"},
                {FULL_GRAPH_ENV: "yes"}):
        with pytest.raises(TreeSpecConfigError, match="invalid value"):
            resolve_settings("fused", env)
    assert resolve_settings("fused", {VARIANT_ENV: "triton"}).variant == "triton"
    with pytest.raises(TreeSpecConfigError, match="not captured in ACL graphs"):
        resolve_settings("fused", {VARIANT_ENV: "triton", FULL_GRAPH_ENV: "1"})


def test_npu_check_runs_through_the_emulation(tmp_path, capsys):
    from vllm_treespec.commands import npu_check

    report = tmp_path / "report.json"
    assert npu_check.main(["--emulate", "--quick", "--json", str(report)]) == 0
    import json
    data = json.loads(report.read_text())
    assert data["ok"] and {c["name"] for c in data["checks"]} >= {
        "numerics/full_mask", "numerics/two_pass", "numerics/tree_sparse",
        "kv_boundaries/full_mask", "kv_boundaries/two_pass", "probe/sparse_mode=9"}
