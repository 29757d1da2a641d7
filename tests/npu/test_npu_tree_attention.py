"""Hardware checks of the Ascend tree attention (skipped without torch_npu).

Run on an Ascend machine with ``python -m pytest tests/npu -q`` (or the fuller
``vllm-treespec npu-check``). Each test issues the backend's exact torch_npu calls
on the device and compares with the eager reference computed on the same device.
"""

import argparse

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")

from vllm_treespec.commands import npu_check  # noqa: E402
from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE  # noqa: E402
from vllm_treespec.attention.ascend.synthetic import (  # noqa: E402
    make_verify_batch,
    probe_tree_sparse,
    verify_with,
)

DEVICE = "npu:0"


@pytest.fixture(scope="module")
def args():
    torch.npu.set_device(DEVICE)
    return argparse.Namespace(heads=32, kv_heads=8, head_size=128, tree_size=33,
                              max_ctx=2000, quick=True)


def _statuses(report):
    return {c["name"]: c for c in report.checks}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_required_variants_match_the_reference(args, dtype):
    report = npu_check.Report()
    npu_check.check_numerics(report, torch_npu, args, DEVICE, dtype)
    npu_check.check_chain(report, torch_npu, args, DEVICE, dtype)
    failed = [c for c in report.checks if c["status"] == "FAIL"]
    assert not failed, failed


class _ShiftedTreeSparse:
    """torch_npu, except that the sparse_mode=9 call's output is shifted: a broken
    tree_sparse kernel the probe must reject."""

    def __getattr__(self, name):
        return getattr(torch_npu, name)

    def npu_fused_infer_attention_score_v2(self, *args, **kwargs):
        out, lse = torch_npu.npu_fused_infer_attention_score_v2(*args, **kwargs)
        return out + 0.5, lse


def test_tree_sparse_probe_gives_a_verdict(args):
    """The probe's verdict agrees with tree_sparse measured against the eager
    reference (not against full_mask, which the probe uses), and it rejects a
    deliberately broken sparse_mode=9 call on this device."""
    res = probe_tree_sparse(torch_npu, DEVICE, torch.bfloat16, args.heads, args.kv_heads,
                            args.head_size, args.tree_size)
    assert res.reason
    batch = make_verify_batch(41, ["tree", "chain", "tree"], args.tree_size, args.heads,
                              args.kv_heads, args.head_size, dtype=torch.bfloat16,
                              device=DEVICE, max_ctx=args.max_ctx)
    rows = batch.tree_rows.rows
    try:
        out = verify_with(torch_npu, TREE_SPARSE, batch)
        err = float((out[rows].float() - batch.reference_output()[rows].float()).abs().max())
    except Exception as e:  # an unsupported combination: the probe must have said no
        err = float("inf")
        assert not res.ok, f"probe enabled tree_sparse, which raises {e!r}"
    assert res.ok == (err <= 3e-2), (res, err)
    broken = probe_tree_sparse(_ShiftedTreeSparse(), DEVICE, torch.bfloat16, args.heads,
                               args.kv_heads, args.head_size, args.tree_size)
    assert not broken.ok, broken


def test_tree_size_above_the_stock_limit_of_16(args):
    big = argparse.Namespace(**{**vars(args), "tree_size": 61})
    report = npu_check.Report()
    npu_check.check_numerics(report, torch_npu, big, DEVICE, torch.bfloat16)
    failed = [c for c in report.checks if c["status"] == "FAIL"]
    assert not failed, failed


def test_acl_graph_replay_matches_eager(args):
    errs = npu_check._graph_roundtrip(torch_npu, FULL_MASK, args, DEVICE, torch.bfloat16)
    assert max(errs) <= 3e-2, errs
