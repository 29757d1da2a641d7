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
from vllm_treespec.attention.ascend.constants import FULL_MASK  # noqa: E402
from vllm_treespec.attention.ascend.synthetic import probe_tree_sparse  # noqa: E402

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


def test_tree_sparse_probe_gives_a_verdict(args):
    res = probe_tree_sparse(torch_npu, DEVICE, torch.bfloat16, args.heads, args.kv_heads,
                            args.head_size, args.tree_size)
    # Either verdict is acceptable; it must come with a reason (logged at startup).
    assert res.reason
    if res.ok:
        assert res.max_abs_err is not None and res.max_abs_err <= 3e-2


def test_tree_size_above_the_stock_limit_of_16(args):
    big = argparse.Namespace(**{**vars(args), "tree_size": 61})
    report = npu_check.Report()
    npu_check.check_numerics(report, torch_npu, big, DEVICE, torch.bfloat16)
    failed = [c for c in report.checks if c["status"] == "FAIL"]
    assert not failed, failed


def test_acl_graph_replay_matches_eager(args):
    errs = npu_check._graph_roundtrip(torch_npu, FULL_MASK, args, DEVICE, torch.bfloat16)
    assert max(errs) <= 3e-2, errs
