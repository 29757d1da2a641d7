"""The only place that imports vLLM internals (vLLM 0.27.1 and 0.32.0; see ``versions``).

``install`` is called by the plugin entry point in every vLLM process. It only
wraps the speculative-config translation, vLLM's override for a served
speculators-format head (``speculators``), the scheduler's constructor (draft
padding and lookahead for tree engines, ``scheduling``) and the frontend's request
validation (the parameters tree engines refuse, ``request_checks``), and registers
the method's name where vLLM has a seam for it (0.34+, ``mrv2.registration``);
everything else is selected through the engine configuration (the worker class)
when the method is ``eagle3_tree``, so stock methods run untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType


def install() -> None:
    # The vLLM version is checked when an eagle3_tree engine is configured
    # (``support.check_vllm_version``): stock methods stay usable on any version.
    from vllm_treespec.vllm_glue.mrv2.registration import register_tree_method
    from vllm_treespec.vllm_glue.request_checks import patch_request_validation
    from vllm_treespec.vllm_glue.scheduling import patch_scheduler
    from vllm_treespec.vllm_glue.spec_config import patch_engine_args, patch_model_runner_choice
    from vllm_treespec.vllm_glue.speculators import patch_speculators_override

    patch_engine_args()
    patch_model_runner_choice()
    patch_scheduler()
    patch_speculators_override()  # after patch_engine_args: wraps its create_engine_config
    patch_request_validation()
    register_tree_method()  # vLLM 0.34+'s seam for the method's name; absent before


def forget_resolved_backends() -> None:
    """Drop vLLM's cache of resolved attention backends: one resolved in this
    process before a tree backend was registered must not stay in use."""
    try:
        from vllm.v1.attention import selector
        selector._cached_get_attn_backend.cache_clear()
    except AttributeError:
        pass


@contextlib.contextmanager
def runner_class_swapped(module: ModuleType, name: str, tree_class: Callable[[type], type],
                         worker: object) -> Iterator[None]:
    """While inside, the runner class a stock worker instantiates by name
    (``module.name``) is the tree runner built from it; restored on exit, so
    the swap lasts for the worker's ``init_device`` only.

    On a clean exit ``worker.model_runner`` must be that tree runner. A vLLM
    whose worker builds its runner some other way would otherwise serve stock
    ``eagle3`` with k = ``num_nodes`` chain drafts: correct, but very slow."""
    from vllm_treespec.config import TreeSpecConfigError

    stock = getattr(module, name, None)
    if not isinstance(stock, type):
        raise TreeSpecConfigError(
            f"eagle3_tree: {module.__name__}.{name} is {stock!r}, not the model runner class "
            f"the worker instantiates; this vLLM builds its runner differently from the "
            f"supported releases, and the tree runner cannot be put in its place")
    built = tree_class(stock)
    setattr(module, name, built)
    try:
        yield
    finally:
        setattr(module, name, stock)
    runner = getattr(worker, "model_runner", None)
    if not isinstance(runner, built):
        raise TreeSpecConfigError(
            f"eagle3_tree: {type(worker).__name__}.init_device built "
            f"{type(runner).__name__}, not the tree runner: the worker no longer "
            f"instantiates {module.__name__}.{name}, the name the plugin swaps; trees would "
            f"be served as stock eagle3 chains of num_nodes drafts")
