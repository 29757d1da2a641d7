"""``eagle3_tree`` through vLLM's own seam for out-of-tree speculative methods.

vLLM 0.34 opens ``register_speculative_method(name, config_cls)`` in
``vllm/v1/worker/gpu/spec_decode/speculator_config.py``, to be called "from a vLLM
general plugin" so that every process knows the method. ``install`` (the plugin's
entry point) calls ``register_tree_method`` in every process; where the seam exists
it registers ``METHOD`` with the qualified name of our ``SpeculatorConfig``
subclass (``method_config.TreeEagle3SpeculatorConfig``), which vLLM resolves only
when a speculative config names the method: that module subclasses 0.34's EAGLE-3
config, so nothing here imports it. Where the seam is absent (0.32.0 and older)
nothing is registered and the engine-args translation keeps naming stock ``eagle3``
(``spec_config.translate``). docs/mrv2.md, "On vLLM 0.34"."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

SEAM = "vllm.v1.worker.gpu.spec_decode.speculator_config"
CONFIG_CLASS = "vllm_treespec.vllm_glue.mrv2.method_config.TreeEagle3SpeculatorConfig"
# What the config names (resolved in the worker by vLLM's init_speculator).
SPECULATOR_CLASS = "vllm_treespec.vllm_glue.mrv2.speculator.RegisteredTreeSpeculator"

_registered = False


def register_tree_method(seam: ModuleType | None = None) -> bool:
    """Register ``eagle3_tree`` with vLLM's ``register_speculative_method`` where the
    release has it (``seam``: that module; default: imported by name). Returns
    whether it did. Idempotent: vLLM accepts the same name with the same config."""
    global _registered
    from vllm_treespec.vllm_glue.spec_config import METHOD

    if seam is None:
        try:
            seam = importlib.import_module(SEAM)
        except ImportError:  # a release without the seam: nothing changes
            return False
    register = getattr(seam, "register_speculative_method", None)
    if register is None:
        return False
    register(METHOD, CONFIG_CLASS)
    _registered = True
    return True


def registered() -> bool:
    """Whether this process registered ``eagle3_tree`` with vLLM's seam."""
    return _registered


def as_registered_method(stock: dict[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
    """The speculative-config dict for a vLLM that registered the method: it names
    ``eagle3_tree`` itself (vLLM moves it to ``custom_method`` and sets ``method`` to
    the config's ``base_method``, ``eagle3``) and carries the tree keys as
    ``speculator_options``, which vLLM admits because our config lists them
    (``supported_options``) and which its ``apply_options`` validates."""
    from vllm_treespec.vllm_glue.spec_config import METHOD

    return dict(stock, method=METHOD, speculator_options=dict(tree))
