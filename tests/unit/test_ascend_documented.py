"""The Ascend variants whose calls torch_npu's docs do not cover, refused or replaced at startup.

``two_pass`` and ``tree_sparse`` issue TND calls without rope inputs, which
torch_npu's op docs cover only for head size 128 or 192 and bfloat16
(``vllm_treespec.attention.ascend.documented``). Run against the stub torch_npu /
vllm_ascend modules of ``test_ascend_glue``: this shows where the glue refuses or
falls back at startup, not that any variant works on an NPU.
"""

import logging

import pytest
import torch

from tests.unit.test_ascend_glue import _config, _impl, _start_worker, glue  # noqa: F401
from vllm_treespec.attention.emulation import EmulatedTorchNPU
from vllm_treespec.config import TreeSpecConfigError

VARIANT_ENV = "VLLM_TREESPEC_ASCEND_VARIANT"


def _served(glue, monkeypatch, variant, head_size, dtype):  # noqa: F811
    """Start the stub worker with ``variant`` for a model of these heads; return
    the worker and one layer's impl, registered for the profiling run."""
    monkeypatch.setenv(VARIANT_ENV, variant)
    config = _config()
    mc = config.model_config
    mc.dtype = dtype
    mc.get_num_attention_heads = lambda pc: 4
    mc.get_num_kv_heads = lambda pc: 2
    mc.get_head_size = lambda: head_size
    worker = _start_worker(glue, config)
    impl = _impl(glue, config=config, head_size=head_size)
    config.compilation_config.static_forward_context.update(
        {"model.layers.0.self_attn.attn": type("Layer", (), {"impl": impl})()})
    return worker, impl


@pytest.mark.parametrize("head_size, dtype, named", [
    (64, torch.bfloat16, "got head size 64"),
    (128, torch.float16, "got dtype float16"),
])
def test_two_pass_is_refused_by_name_at_startup(glue, monkeypatch, head_size,  # noqa: F811
                                                dtype, named):
    worker, _ = _served(glue, monkeypatch, "two_pass", head_size, dtype)
    with pytest.raises(TreeSpecConfigError) as e:
        worker.model_runner.profile_run()
    msg = str(e.value)
    assert "VLLM_TREESPEC_ASCEND_VARIANT: 'two_pass'" in msg and named in msg, msg
    assert "head size 128 or 192 and dtype bfloat16" in msg


def test_two_pass_at_a_documented_head_size_starts(glue, monkeypatch):  # noqa: F811
    worker, impl = _served(glue, monkeypatch, "two_pass", 128, torch.bfloat16)
    worker.model_runner.profile_run()
    assert impl.tree_variant == "two_pass"
    assert worker.model_runner.seen_at_profiling > 0


@pytest.mark.parametrize("head_size, dtype", [(64, torch.bfloat16), (128, torch.float16)])
def test_tree_sparse_falls_back_to_full_mask_unprobed(glue, monkeypatch, caplog,  # noqa: F811
                                                      head_size, dtype):
    # The stub torch_npu has no attention ops: a probe that ran would fail on them
    # with an AttributeError, not decline with the documented limits.
    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        worker, impl = _served(glue, monkeypatch, "tree_sparse", head_size, dtype)
    assert impl.tree_variant == "full_mask"
    assert "using full_mask: not probed: 'tree_sparse' issues" in caplog.text
    worker.model_runner.profile_run()  # full_mask's buffers: no refusal


def test_tree_sparse_at_a_documented_head_size_is_probed(glue, monkeypatch):  # noqa: F811
    # The probe runs there: through the emulation it agrees with full_mask, so the
    # (undocumented) tree-mask call is kept. On a device only the probe can tell.
    ops = EmulatedTorchNPU()
    monkeypatch.setattr(glue.worker, "torch_npu", ops)
    worker, impl = _served(glue, monkeypatch, "tree_sparse", 128, torch.bfloat16)
    assert impl.tree_variant == "tree_sparse"
    assert {(c["op"], c.get("sparse_mode")) for c in ops.calls} >= {
        ("npu_fused_infer_attention_score_v2", 9), ("npu_fused_infer_attention_score", 0)}
    worker.model_runner.profile_run()
