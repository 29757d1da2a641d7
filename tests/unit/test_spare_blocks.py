"""The CPU runner reserves spare KV blocks past the scheduler's (for chain_split)."""

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from vllm_treespec.vllm_glue.cpu_runner import _CPUDevice


class _Allocator:
    """What vLLM's runner does: one int8 tensor of the configured size per layer."""

    def _allocate_kv_cache_tensors(self, kv_cache_config):
        out = {}
        for t in kv_cache_config.kv_cache_tensors:
            tensor = torch.zeros(t.size, dtype=torch.int8)
            out.update({name: tensor for name in t.shared_by})
        return out


class _Runner(_CPUDevice, _Allocator):
    pass


def test_each_layer_gets_spare_pages_and_the_scheduler_config_is_untouched():
    page = 3 * 128 * 2 * 64 * 4
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=[], kv_cache_tensors=[
        KVCacheTensor(size=10 * page, shared_by=["a"]),
        KVCacheTensor(size=10 * page, shared_by=["b", "c"])])
    raw = _Runner()._allocate_kv_cache_tensors(cfg)
    assert {n: t.numel() // page for n, t in raw.items()} == {
        "a": 10 + _CPUDevice.SPARE_BLOCKS, "b": 10 + _CPUDevice.SPARE_BLOCKS,
        "c": 10 + _CPUDevice.SPARE_BLOCKS}
    assert raw["b"] is raw["c"]  # shared tensors stay shared
    assert cfg.num_blocks == 10 and cfg.kv_cache_tensors[0].size == 10 * page


def test_packed_layouts_get_none():
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=[], kv_cache_tensors=[
        KVCacheTensor(size=1000, shared_by=["a"], block_stride=100)])
    runner = _Runner()
    assert runner._allocate_kv_cache_tensors(cfg)["a"].numel() == 1000
    assert not getattr(runner, "_spare_bytes", 0)
