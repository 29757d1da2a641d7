"""Worker classes selected (``parallel_config.worker_cls``) in tree mode.

Each builds the device's stock model runner with the tree mixin, by swapping the
runner class name the stock worker instantiates for the duration of
``init_device`` only, and installs the device's tree attention backend first.
"""

from __future__ import annotations

import importlib

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_treespec.vllm_glue import cpu_attention, runner_class_swapped, versions
from vllm_treespec.vllm_glue.cpu_runner import tree_cpu_runner_class


class TreeCPUWorker(CPUWorker):
    def init_device(self):
        import vllm.v1.worker.cpu_worker as cpu_worker

        cpu_attention.install()
        model_config, cache_config = self.vllm_config.model_config, self.vllm_config.cache_config
        cpu_attention.probe_kv_layout(model_config.dtype, cache_config.block_size,
                                      model_config.get_head_size())
        site = versions.mrv2_runner_site(self.vllm_config)
        if site is not None:  # the MRV2 runner class, where the worker takes it from
            from vllm_treespec.vllm_glue.mrv2.runner import tree_mrv2_runner_class

            with runner_class_swapped(importlib.import_module(site[0]), site[1],
                                      tree_mrv2_runner_class, self):
                super().init_device()
            return
        # Checks that the worker built the tree runner (not, e.g., vLLM's V2 runner).
        with runner_class_swapped(cpu_worker, "CPUModelRunner", tree_cpu_runner_class, self):
            super().init_device()

