"""Startup refusals of the Ascend glue and the memory its buffers hold.

Pure checks (``vllm_glue.ascend.checks``) over config-shaped objects and the
buffers' reservation on CPU tensors: no torch_npu or vllm_ascend involved, so
nothing here says the NPU path works, only that these refusals and sizes are
what the code applies there.
"""

import types

import pytest
import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.constants import VARIANTS
from vllm_treespec.attention.ascend.plans import pad_plan, plan_tree_rows
from vllm_treespec.attention.ascend.synthetic import make_verify_batch
from vllm_treespec.attention.ascend.execute import run_tree_verify
from vllm_treespec.attention.emulation import EmulatedTorchNPU
from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue.ascend import checks
from vllm_treespec.vllm_glue.support import ALLOW_UNTESTED_ENV

NS = types.SimpleNamespace


def _config(block_size=128, cache_dtype="auto", quant=None, use_mla=False):
    return NS(model_config=NS(use_mla=use_mla, hf_config=NS(model_type="deepseek_v3"),
                              max_model_len=1024),
              cache_config=NS(block_size=block_size, cache_dtype=cache_dtype),
              quant_config=quant, scheduler_config=NS(max_num_seqs=4))


def test_a_supported_engine_config_passes():
    checks.check_engine(_config())


@pytest.mark.parametrize("config, named", [
    (_config(block_size=16), "'block_size' has invalid value 16; allowed: 128"),
    (_config(cache_dtype="int8"), "'kv_cache_dtype' has invalid value 'int8'"),
    (_config(quant=NS(enable_c8_quant=True)), "enable_c8_quant=True"),
    (_config(quant=NS(enable_c8_quant=False, enable_fa_quant=True)), "enable_fa_quant=True"),
    (_config(use_mla=True), "MLA models"),
])
def test_each_unsupported_engine_setting_is_refused_by_name(config, named):
    with pytest.raises(TreeSpecConfigError) as e:
        checks.check_engine(config)
    assert named in str(e.value), str(e.value)


@pytest.mark.parametrize("cann", ["9.1.0", "CANN-9.1.0.post2"])
def test_the_paired_cann_passes(cann, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    checks.check_cann("0.27.1", cann)


@pytest.mark.parametrize("cann", [None, "8.5.0", "9.2.0"])
def test_another_cann_is_refused_naming_found_and_supported(cann, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(TreeSpecConfigError) as e:
        checks.check_cann("0.27.1", cann)
    assert f"found CANN {cann!r}" in str(e.value) and "CANN 9.1.0" in str(e.value)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    checks.check_cann("0.27.1", cann)


def test_no_attention_groups_fails_startup():
    with pytest.raises(TreeSpecConfigError, match="no attention groups"):
        checks.check_attention_groups([[], []])
    checks.check_attention_groups([[object()]])


def test_a_layer_whose_impl_was_swapped_fails_startup():
    class Stock:  # vllm-ascend's AscendAttentionBackendImpl
        pass

    class Tree(Stock):
        pass

    class C8(Stock):  # what vllm-ascend's kv_c8 assigns to layer.impl.__class__
        pass

    layers = {"model.layers.0.attn": NS(impl=Tree(), attn_backend=object),
              "model.layers.1.attn": NS(impl=C8(), attn_backend=object),
              "model.layers.0.mlp.experts": NS(quant_method=None)}  # not attention
    with pytest.raises(TreeSpecConfigError, match=r"model.layers.1.attn: C8"):
        checks.check_layer_impls(layers, Tree)
    del layers["model.layers.1.attn"]
    checks.check_layer_impls(layers, Tree)


def _impl_init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
               sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
               kv_sharing_target_layer_name, sinks=None, **kwargs):
    """vllm-ascend's AscendAttentionBackendImpl.__init__ signature (182b75e)."""


@pytest.mark.parametrize("change, named", [
    ({"alibi_slopes": [0.5]}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"sliding_window": 4096}, "sliding-window"),
    ({"sinks": torch.zeros(2)}, "attention sinks"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
])
def test_attention_features_the_tree_calls_ignore_are_refused(change, named):
    args = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None)
    checks.check_layer_arguments(_impl_init, tuple(args.values()), {})
    checks.check_layer_arguments(_impl_init, (), args)
    with pytest.raises(TreeSpecConfigError, match=named):  # keyword, as vLLM may pass it
        checks.check_layer_arguments(_impl_init, (), {**args, **change})
    positional = {**args, **change}
    sinks = positional.pop("sinks", None)
    with pytest.raises(TreeSpecConfigError, match=named):  # positional
        checks.check_layer_arguments(_impl_init, tuple(positional.values()),
                                     {} if sinks is None else {"sinks": sinks})


def _batch_and_buffers(max_reqs=6, head_size=16, dtype=torch.float32):
    batch = make_verify_batch(3, ["tree", "causal", "tree"], 9, 4, 2, head_size,
                              dtype=dtype, device="cpu", max_ctx=300)
    plan = pad_plan(plan_tree_rows(batch.tree_rows), 9)
    bufs = TreeAttentionBuffers(max_reqs, 9, 4, 2, head_size, dtype, "cpu", max_blocks=4)
    return batch, plan, bufs


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_reservation_holds_everything_a_step_then_uses(variant):
    # Head size 128 in bfloat16: a shape every variant's calls are documented for.
    batch, plan, bufs = _batch_and_buffers(head_size=128, dtype=torch.bfloat16)
    held = bufs.reserve(variant)
    assert held == bufs.allocated_bytes()
    names = set(bufs._tensors)
    run_tree_verify(EmulatedTorchNPU(allow_float32=True), variant, plan, bufs, batch.query,
                    batch.key, batch.value, batch.key_cache, batch.value_cache,
                    batch.heads, torch.zeros_like(batch.query))
    assert set(bufs._tensors) == names, "a step allocated past the profiling reservation"
    assert bufs.allocated_bytes() == held


def test_each_reservation_is_the_documented_formula():
    _, _, bufs = _batch_and_buffers(max_reqs=6)
    R, T, C, H, KVH, D, s = 6, 9, 4 * 128, 4, 2, 16, 4
    # docs/ascend.md, Memory: the table of bytes held per variant.
    assert bufs.reserved_bytes("full_mask") == R * T * C + 2 * R * T * H * D * s + 4
    assert bufs.reserved_bytes("two_pass") == (R * T * T + (3 * H + 2 * KVH) * R * T * D * s
                                               + 8 * R * T * H)
    assert bufs.reserved_bytes("tree_sparse") == R * T * T + R * T * H * D * s + 4
    assert bufs.reserved_bytes("triton") == 0


def test_a_step_past_the_buffers_says_what_to_change():
    _, plan, bufs = _batch_and_buffers(max_reqs=1)  # the plan holds the 2 tree requests
    cfg = _config()
    with pytest.raises(RuntimeError, match=r"max_num_seqs \+ 2 = 1 .*VLLM_TREESPEC_EXEC_MODE"):
        checks.check_step_fits(plan, bufs, cfg)
    _, plan, bufs = _batch_and_buffers()
    checks.check_step_fits(plan, bufs, cfg)
    bufs.max_blocks = 1
    with pytest.raises(RuntimeError, match=r"raise --max-model-len to at least"):
        checks.check_step_fits(plan, bufs, cfg)


# ---- variants whose calls torch_npu's docs do not cover for these heads --------------
@pytest.mark.parametrize("variant", ["two_pass", "tree_sparse"])
@pytest.mark.parametrize("head_size, dtype, named", [
    (64, torch.bfloat16, "got head size 64"),
    (128, torch.float16, "got dtype float16"),
    (96, torch.float32, "got head size 96 and dtype float32"),
])
def test_a_tnd_variant_is_refused_by_name_outside_its_documented_heads(
        variant, head_size, dtype, named):
    bufs = TreeAttentionBuffers(2, 5, 4, 2, head_size, dtype, "cpu", max_blocks=2)
    with pytest.raises(TreeSpecConfigError) as e:
        bufs.reserve(variant)
    msg = str(e.value)
    assert f"VLLM_TREESPEC_ASCEND_VARIANT: {variant!r}" in msg and named in msg, msg
    assert "head size 128 or 192 and dtype bfloat16" in msg and "'full_mask'" in msg
    assert bufs.allocated_bytes() == 0


@pytest.mark.parametrize("variant, head_size, dtype", [
    ("two_pass", 128, torch.bfloat16), ("two_pass", 192, torch.bfloat16),
    ("tree_sparse", 128, torch.bfloat16),
    ("full_mask", 64, torch.float16), ("triton", 96, torch.float16),
])
def test_documented_heads_and_the_bsnd_variants_are_accepted(variant, head_size, dtype):
    bufs = TreeAttentionBuffers(2, 5, 4, 2, head_size, dtype, "cpu", max_blocks=2)
    assert bufs.reserve(variant) == bufs.allocated_bytes()


def test_the_tree_sparse_probe_declines_undocumented_heads_without_running():
    from vllm_treespec.attention.ascend.synthetic import probe_tree_sparse

    class NoCalls:  # any torch_npu call would be a failure of the test
        def __getattr__(self, name):
            raise AssertionError(f"the probe issued {name}")

    for head_size, dtype, named in ((64, torch.bfloat16, "head size 64"),
                                    (128, torch.float16, "dtype float16")):
        res = probe_tree_sparse(NoCalls(), "cpu", dtype, 4, 2, head_size, 5)
        assert not res.ok and res.reason.startswith("not probed") and named in res.reason
