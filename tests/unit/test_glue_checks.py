"""Startup checks of the glue that keep a broken hook from serving silently."""

from __future__ import annotations

import types

import pytest

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import runner_class_swapped


class _StockRunner:
    pass


def _tree_class(base: type) -> type:
    return type("TreeRunner", (base,), {})


def _worker_module() -> types.ModuleType:
    module = types.ModuleType("fake_worker")
    module.StockRunner = _StockRunner
    return module


def test_a_worker_that_builds_its_runner_through_the_swapped_name_passes():
    module = _worker_module()

    class Worker:
        def init_device(self):
            self.model_runner = module.StockRunner()

    worker = Worker()
    with runner_class_swapped(module, "StockRunner", _tree_class, worker):
        worker.init_device()
    assert type(worker.model_runner).__name__ == "TreeRunner"
    assert module.StockRunner is _StockRunner  # restored


def test_a_worker_that_builds_its_runner_another_way_fails_startup():
    """It would have served stock eagle3 with k = num_nodes (the old swap did not
    look at what the worker built)."""
    module = _worker_module()

    class Worker:
        def init_device(self):
            self.model_runner = _StockRunner()  # not through module.StockRunner

    worker = Worker()
    with pytest.raises(TreeSpecConfigError, match=r"Worker.init_device built _StockRunner, not "
                                                  r"the tree runner.*fake_worker.StockRunner"):
        with runner_class_swapped(module, "StockRunner", _tree_class, worker):
            worker.init_device()
    assert module.StockRunner is _StockRunner


def test_a_worker_module_without_the_swapped_name_fails_startup_naming_it():
    module = types.ModuleType("fake_worker")
    with pytest.raises(TreeSpecConfigError, match=r"fake_worker.StockRunner is None, not the "
                                                  r"model runner class"):
        with runner_class_swapped(module, "StockRunner", _tree_class, object()):
            pass


def test_an_error_inside_init_device_is_not_masked_by_the_check():
    module = _worker_module()
    with pytest.raises(RuntimeError, match="out of memory"):
        with runner_class_swapped(module, "StockRunner", _tree_class, object()):
            raise RuntimeError("out of memory")
    assert module.StockRunner is _StockRunner
