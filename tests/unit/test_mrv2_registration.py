"""``eagle3_tree`` registered through vLLM 0.34's seam (``vllm_glue/mrv2/registration.py``).

vLLM 0.34.0 cannot run on this CPU (no triton-cpu, no CPU wheel), but two of its
files import cleanly against the installed vLLM 0.32.0: the seam,
``v1/worker/gpu/spec_decode/speculator_config.py``, and EAGLE-3's config,
``spec_decode/eagle/config.py``. The tests marked ``v034`` load those two real files
from the unpacked 0.34.0 sources (``<cache>/vllm-0.34.0-src``, docs/mrv2.md "On vLLM
0.34") under their own module names, for one test at a time, and drive them:

- our ``register_tree_method``, given that module, registers ``eagle3_tree`` with
  our config's qualified name, and 0.34's own ``get_custom_speculator_config_class``
  resolves it to a subclass of 0.34's ``Eagle3SpeculatorConfig`` naming our
  speculator; its ``apply_options`` admits the plugin's tree keys and refuses others;
- the import-free check (``commands.mrv2_api``) finds every row, the registration's
  included, as the table expects in the 0.34.0 tree.

They do not run 0.34's ``SpeculativeConfig``, ``init_speculator`` or runner (those
import what 0.32.0 lacks): the speculator class is checked against 0.32.0's
``BaseSpeculator`` and the constructor call ``init_speculator`` makes (read from
0.34's source by the row check). Skipped where the sources are absent. Without them
(and everywhere): no seam on 0.32.0 means nothing registered, and the wiring of
the runner to a speculator vLLM built (a stand-in runner base, our wiring only).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import ModuleType, SimpleNamespace

import pytest

from vllm_treespec.assets import cache_home
from vllm_treespec.commands import mrv2_api
from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.vllm_glue.mrv2 import registration

SRC = cache_home() / "vllm-0.34.0-src"
EAGLE_CONFIG = "vllm.v1.worker.gpu.spec_decode.eagle.config"
SEAM_FILES = {registration.SEAM: "v1/worker/gpu/spec_decode/speculator_config.py",
              EAGLE_CONFIG: "v1/worker/gpu/spec_decode/eagle/config.py"}
OUR_CONFIG = "vllm_treespec.vllm_glue.mrv2.method_config"
TREE = TreeSpecConfig.from_dict({"adaptive": False, "copy_branches": 0, "num_nodes": 5,
                                 "depth": 3, "top_k": 2})
v034 = pytest.mark.skipif(not (SRC / "vllm" / SEAM_FILES[registration.SEAM]).is_file(),
                          reason=f"vLLM 0.34.0's sources are not unpacked in {SRC}")


@pytest.fixture
def seam034(monkeypatch):
    """0.34.0's seam and EAGLE-3 config modules, loaded from its files; removed after."""
    pytest.importorskip("vllm")
    monkeypatch.delitem(sys.modules, OUR_CONFIG, raising=False)
    modules = {}
    for name, rel in SEAM_FILES.items():
        spec = importlib.util.spec_from_file_location(name, SRC / "vllm" / rel)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        modules[name] = module
    monkeypatch.setattr(registration, "_registered", False)
    yield modules[registration.SEAM], modules[EAGLE_CONFIG]
    sys.modules.pop(OUR_CONFIG, None)  # it subclassed the module loaded here


@v034
def test_registration_names_our_config_through_0_34s_seam(seam034):
    seam, eagle = seam034
    assert registration.register_tree_method(seam) is True
    assert registration.registered()
    assert seam.registered_speculative_methods() == ["eagle3_tree"]
    assert seam._CUSTOM_CONFIGS["eagle3_tree"] == registration.CONFIG_CLASS  # lazily, by name
    assert registration.register_tree_method(seam) is True  # every process: idempotent
    config = seam.get_custom_speculator_config_class("eagle3_tree")  # 0.34's own resolution
    assert config.__module__ == OUR_CONFIG and config.__name__ == "TreeEagle3SpeculatorConfig"
    assert issubclass(config, eagle.Eagle3SpeculatorConfig)
    assert config.base_method == "eagle3"  # vLLM sets SpeculativeConfig.method to it
    assert config.speculator_class == registration.SPECULATOR_CLASS
    assert registration.SPECULATOR_CLASS.endswith("mrv2.speculator.RegisteredTreeSpeculator")
    assert {"speculator_options", "draft_lm_head_quantization"} <= config.supported_options
    assert config.supports_watermarking is False
    with pytest.raises(ValueError, match="already registered"):
        seam.register_speculative_method("eagle3_tree", "some.other.Config")


@v034
def test_the_config_takes_the_plugins_tree_keys_and_refuses_others(seam034):
    seam, _ = seam034
    registration.register_tree_method(seam)
    config = seam.get_custom_speculator_config_class("eagle3_tree")
    stock = registration.as_registered_method(
        {"method": "eagle3", "model": "head", "num_speculative_tokens": TREE.num_nodes},
        TREE.to_dict())
    assert stock["method"] == "eagle3_tree" and stock["model"] == "head"
    spec = SimpleNamespace(draft_lm_head_quantization=None, draft_model_config=None,
                           speculator_options=stock["speculator_options"],
                           num_speculative_tokens=stock["num_speculative_tokens"])
    config.apply_options(spec)  # EAGLE's own check runs too (no head quantization)
    for bad, match in (({"speculator_options": None}, "no 'speculator_options'"),
                       ({"num_speculative_tokens": 4}, "num_speculative_tokens"),
                       ({"speculator_options": {"num_nodez": 5}}, "num_nodez")):
        with pytest.raises(TreeSpecConfigError, match=match):
            config.apply_options(SimpleNamespace(**{**vars(spec), **bad}))


@v034
def test_every_row_holds_in_the_0_34_sources():
    results = mrv2_api.check(mrv2_api.Source(SRC), "0.34.0")
    assert [r.row.where for r in results if not r.ok] == []
    assert mrv2_api.Source(SRC).release() == "0.34.0"


def test_without_the_seam_nothing_is_registered(monkeypatch):
    monkeypatch.setattr(registration, "_registered", False)
    assert registration.register_tree_method(ModuleType("no_seam")) is False
    assert not registration.registered()
    if importlib.util.find_spec("vllm") is not None:
        try:
            importlib.import_module(registration.SEAM)
        except ImportError:  # 0.32.0: the module does not exist
            assert registration.register_tree_method() is False
            assert not registration.registered()


def test_the_speculator_is_built_as_0_34s_init_speculator_builds_it():
    """``init_speculator`` (0.34) checks the class is a ``BaseSpeculator`` and calls it
    with ``(vllm_config, device)`` unless it takes ``req_states`` (read by the row
    check); here against 0.32.0's ``BaseSpeculator``."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    module, name = registration.SPECULATOR_CLASS.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaseSpeculator)
    assert list(inspect.signature(cls).parameters) == ["vllm_config", "device"]


def test_the_runner_adopts_the_speculator_vllm_built(monkeypatch):
    """Our wiring only, on a stand-in runner base: where vLLM built our speculator from
    the registered config, the tree runner shares its step state and binds the KV move,
    which the speculator refuses to run without."""
    pytest.importorskip("vllm")
    from vllm_treespec.vllm_glue.mrv2 import speculator as spec_mod
    from vllm_treespec.vllm_glue.mrv2.runner import tree_mrv2_runner_class
    from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps

    monkeypatch.setenv("VLLM_TREESPEC_MRV2_PREVIEW", "1")
    built = object.__new__(spec_mod.RegisteredTreeSpeculator)
    built.steps = TreeSteps(spec_mod._kv_move_unbound)
    with pytest.raises(TreeSpecConfigError, match="other than the tree runner"):
        built.load_model(None)
    built.steps.proposed[3] = "stale"
    built.add_request(3)
    assert 3 not in built.steps.proposed

    class StandIn:  # what GPUModelRunner.__init__ leaves: init_speculator's product
        def __init__(self, vllm_config, device):
            self.device, self.speculator = device, built

    config = SimpleNamespace(additional_config={"eagle3_tree": TREE.to_dict()})
    runner = tree_mrv2_runner_class(StandIn)(config, "cpu")
    assert runner.speculator is built and runner.tree_steps is built.steps
    assert built.steps.move_kv == runner._move_kv
