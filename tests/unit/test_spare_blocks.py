"""The CPU runner reserves spare KV blocks past the scheduler's (for chain_split),
in the KV-cache layout of the installed vLLM (see ``versions.grow_kv_cache_config``)."""

import dataclasses

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

from vllm_treespec.vllm_glue import versions
from vllm_treespec.vllm_glue.cpu_runner import _CPUDevice

PAGE = 3 * 128 * 2 * 64 * 4
LAYERED = "layer_stride" in {f.name for f in dataclasses.fields(KVCacheTensor)}  # 0.32.0


def tensors(num_blocks: int, layer_groups: list[list[str]]) -> list:
    """KVCacheTensors as vLLM makes them: one per layer group on 0.27.1; on 0.32.0 one
    backing allocation, each group's layers one after another (layer-outermost)."""
    if not LAYERED:
        return [KVCacheTensor(size=num_blocks * PAGE, shared_by=g) for g in layer_groups]
    region = num_blocks * PAGE
    size = region * sum(len(g) for g in layer_groups)
    out, offset = [], 0
    for g in layer_groups:
        out.append(KVCacheTensor(size=size, layers=g, layer_stride=region, block_stride=PAGE,
                                 offset=offset))
        offset += region * len(g)
    return out


class _Allocator:
    """What vLLM's runner allocates for a config: [num_blocks, page] int8 views per layer
    (0.27.1: a tensor per KVCacheTensor, its block count from its size; 0.32.0: views of
    one backing buffer at offset + l * layer_stride + b * block_stride)."""

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes=None):
        out = {}
        ts = kv_cache_config.kv_cache_tensors
        if not LAYERED:
            for t in ts:
                tensor = torch.zeros(t.size, dtype=torch.int8)
                out.update({name: tensor for name in t.shared_by})
            return out
        buf = torch.zeros(ts[0].size, dtype=torch.int8)
        num = kv_cache_config.num_blocks
        for t in ts:
            for i, name in enumerate(t.layers):
                start = t.offset + i * t.layer_stride
                assert start + num * t.block_stride <= buf.numel()
                out[name] = buf[start: start + num * t.block_stride].view(num, -1)
        return out


class _Runner(_CPUDevice, _Allocator):
    pass


def test_each_layer_gets_spare_pages_and_the_scheduler_config_is_untouched():
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=[],
                        kv_cache_tensors=tensors(10, [["a"], ["b", "c"]]))
    before = dataclasses.replace(cfg)
    raw = _Runner().initialize_kv_cache_tensors(cfg, [16])
    assert {n: t.numel() // PAGE for n, t in raw.items()} == {
        n: 10 + _CPUDevice.SPARE_BLOCKS for n in "abc"}
    # Layers never overlap, spare pages included.
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in
                    {id(t): t for t in raw.values()}.values())
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    if not LAYERED:
        assert raw["b"] is raw["c"]  # shared tensors stay shared
    assert cfg == before and cfg.num_blocks == 10  # the scheduler's config is untouched


def test_packed_layouts_get_none():
    if LAYERED:  # block-outermost: a block holds every layer's page
        packed = KVCacheTensor(size=10 * PAGE * 2, layers=["a", "b"], layer_stride=PAGE,
                               block_stride=2 * PAGE)
    else:
        packed = KVCacheTensor(size=1000, shared_by=["a"], block_stride=100)
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=[], kv_cache_tensors=[packed])
    assert versions.grow_kv_cache_config(cfg, 8) is None
    runner = _Runner()
    if not LAYERED:
        assert runner.initialize_kv_cache_tensors(cfg)["a"].numel() == 1000
    assert not getattr(runner, "_spare_bytes", 0)
