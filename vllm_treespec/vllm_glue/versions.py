"""What each supported vLLM release needs: the one place for version differences.

The rest of ``vllm_glue/`` calls the helpers here instead of testing vLLM's
version itself. Each helper says which releases differ and how; where a
difference can be bridged without naming a version (a new return value passed
through, an attribute that moved), it is, so that a release between the tested
ones behaves like its neighbours.

Releases (``SUPPORTED``; a release is listed once the greedy, T > 0 and HTTP
integration tests have passed on it, see the README's support matrix):

* **0.27.1**: the first one this glue was written for.
* **0.28.0**, **0.29.0**: need nothing of their own (tested with ``scripts/test-release.sh``).
* **0.30.0**: needs nothing of its own; each bridge below tells it apart by
  what it has, not by its number (tested with ``scripts/test-release.sh``).
* **0.31.0**: the same; it pins transformers below 5.18, hence our lower bounds
  (transformers 5.17, huggingface_hub 1.33: what pip installs beside it).
* **0.32.0**: the default install. Against 0.27.1:
  - ``ModelConfig.uses_xdrope_dim`` is gone (XD-RoPE is read as M-RoPE:
    ``uses_mrope`` covers both);
  - ``GPUModelRunner._prepare_inputs`` returns a third value (the most sampled
    tokens of a request), passed through by the runner as it is;
  - every layer's KV cache is a view into one backing allocation sized from
    ``KVCacheTensor.layer_stride`` / ``block_stride`` (``layers`` instead of
    ``shared_by``), allocated by ``initialize_kv_cache_tensors`` instead of
    ``_allocate_kv_cache_tensors``: see ``grow_kv_cache_config``;
  - the CPU attention kernel's ISA is an attribute of each attention layer,
    no longer of the backend implementation (``attention_isa``);
  - the CPU attention backend takes blocks of multiples of 32 tokens only
    (0.27.1: 16);
  - speculative metadata is built for steps without drafts too, and the stock
    rejection sampler fails on them under top-k: the runner samples such steps
    as plain ones (``drafts_metadata``);
  - the speculative config has keys trees set themselves
    (``NEWER_STOCK_KEYS_TREES_SET``, refused in a tree config);
  - the CPU sampler draws a seeded row with a fused Gumbel-max kernel seeded
    from the request's generator, no longer with Exp(1) noise from it: tree
    steps draw seeded positions with vLLM's own op (``seeded_draws.seeded_draws``);
  - the V2 model runner is the default where Triton runs: tree engines fall
    back to V1 (``keep_v1_model_runner``); asked for by name
    (``VLLM_USE_V2_MODEL_RUNNER=1``, ``uses_model_runner_v2``), fixed trees run on
    it (``vllm_glue/mrv2``), whose rejection sampler takes ``invalid_drafts`` (a
    fourth argument newer releases drop: ``mrv2.sampler`` passes on what it gets);
  - 0.34.0 (not supported; read from its sources only) has no V1 runner: every
    engine is MRV2, whose CPU worker imports its runner at module level
    (``uses_model_runner_v2``, ``mrv2_runner_site``);
  - whether a structured-output request's grammar constrains its next token
    (not yet, inside a reasoning parser's thinking part) is
    ``StructuredOutputManager._get_constraint_bounds``; 0.27.1 asks
    ``should_fill_bitmask`` (``grammar_constrains_next``);
  - the xgrammar backend compiles a request's grammar with its stop tokens
    (``compile_grammar(..., stop_token_ids)``); 0.27.1 without
    (``compile_request_grammar``);
  - EAGLE's drop of a prefix-cache hit's last block has a switch
    (``SpeculativeConfig.disable_eagle_block_drop``); 0.27.1 has none, and its
    KV cache coordinator's EAGLE groups are cleared instead
    (``switch_block_drop_off``, ``clear_block_drop``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

DEFAULT = "0.32.0"
SUPPORTED = ("0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


def installed_release() -> str:
    """The installed vLLM's release as ``X.Y.Z`` (a local suffix such as ``+cpu`` dropped)."""
    import vllm
    from packaging.version import InvalidVersion, Version

    found = getattr(vllm, "__version__", "unknown")
    try:
        return ".".join(map(str, Version(found).release[:3]))
    except InvalidVersion:
        return found


def uses_position_sections(model_config: Any) -> bool:
    """M-RoPE (or, on 0.27.1, XD-RoPE): several position ids per token."""
    return bool(model_config.uses_mrope or getattr(model_config, "uses_xdrope_dim", 0))


def attention_isa(impl: Any, layer: Any) -> str:
    """The CPU attention kernel's ISA for ``layer`` (on the layer since 0.32.0,
    on the implementation before)."""
    isa = getattr(layer, "isa", None)
    return isa if isa is not None else impl.isa


def grow_kv_cache_config(kv_cache_config: Any, extra: int) -> tuple[Any, int] | None:
    """A copy of ``kv_cache_config`` whose every layer has ``extra`` blocks past the
    scheduler's ``num_blocks``, and the bytes that adds; None where the layout does
    not allow it (nothing is then reserved).

    0.27.1: one tensor per layer group, ``size`` bytes, blocks contiguous: each
    size grows by ``extra`` pages (``num_blocks`` stays: the runner derives the
    block count from the tensor's size). 0.32.0: one backing allocation; each
    layer's region is ``layer_stride`` bytes of ``num_blocks`` pages
    (layer-outermost): ``num_blocks``, the strides and the size grow together.
    A block-outermost layout (a block holds every layer's page) gets none.
    """
    num = kv_cache_config.num_blocks
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return None
    if not hasattr(tensors[0], "layer_stride"):  # 0.27.1
        if any(t.block_stride or t.size % num for t in tensors):  # packed layouts
            return None
        grown = [dataclasses.replace(t, size=t.size // num * (num + extra)) for t in tensors]
        return (dataclasses.replace(kv_cache_config, kv_cache_tensors=grown),
                sum(t.size // num * extra for t in tensors))
    sizes = {t.size for t in tensors}
    if (len(sizes) != 1 or any(t.block_stride * num != t.layer_stride or t.offset % num
                               for t in tensors) or next(iter(sizes)) % num):
        return None
    size, scale = sizes.pop(), num + extra
    grown = [dataclasses.replace(t, layer_stride=t.block_stride * scale,
                                 offset=t.offset // num * scale,
                                 size=size // num * scale) for t in tensors]
    return (dataclasses.replace(kv_cache_config, num_blocks=scale, kv_cache_tensors=grown),
            size // num * extra)


# SpeculativeConfig's switch (0.32.0) for EAGLE's last-block drop on prefix hits.
BLOCK_DROP_SWITCH = "disable_eagle_block_drop"

# Why a tree engine keeps a prefix-cache hit whole: stock EAGLE drops a hit's
# last block and recomputes it (128 tokens on the CPU) so that its drafter sees
# the target's states there and reuses no drafter KV written past a chunk's end.
# A tree's drafts are proposals only: such drafter KV can cost acceptance, never
# a token of the output, while the recomputed block is prefill that every hit
# pays and plain vLLM does not.


def switch_block_drop_off(stock: dict[str, Any], stock_keys: set[str]) -> bool:
    """0.32.0: set the switch in the stock speculative-config dict (unless the
    user set it); whether it did. 0.27.1 has no switch (``clear_block_drop``)."""
    if BLOCK_DROP_SWITCH not in stock_keys or BLOCK_DROP_SWITCH in stock:
        return False
    stock[BLOCK_DROP_SWITCH] = True
    return True


def clear_block_drop(kv_cache_manager: Any, speculative_config: Any) -> bool:
    """0.27.1: the scheduler's KV cache coordinator drops the last block for its
    EAGLE groups, read at every lookup: cleared (one KV cache group, as
    ``support.check_kv_cache_groups`` requires); whether there were any. A
    release with the switch is left as its config says."""
    coordinator = kv_cache_manager.coordinator
    if (hasattr(speculative_config, BLOCK_DROP_SWITCH)
            or not getattr(coordinator, "eagle_group_ids", None)):
        return False
    coordinator.eagle_group_ids = set()
    for manager in coordinator.single_type_managers:
        manager.use_eagle = False
    kv_cache_manager.use_eagle = False
    return True


@dataclasses.dataclass(frozen=True)
class AscendPairing:
    """The vllm-ascend build the Ascend glue was mapped on for one vLLM release, and
    the torch_npu / CANN that build pairs with (vllm-ascend's own requirements)."""

    vllm_ascend_commit: str  # short hash of vllm-ascend main the hooks were read on
    vllm_ascend_date: str
    torch_npu: str
    cann: str


# vLLM release -> the vllm-ascend it runs on. 0.30.0 to 0.32.0 have none yet: the hooks were
# only mapped on vllm-ascend main of 2026-08-22 (which pairs with vLLM 0.27.1); a
# newer vllm-ascend could not be read here (docs/ascend.md).
ASCEND_PAIRINGS: dict[str, AscendPairing] = {
    "0.27.1": AscendPairing("182b75e", "2026-08-22", "2.10.0.post4", "9.1.0"),
}


# Stock speculative-config keys of 0.32.0 (0.27.1 has none of them) that trees set
# themselves, with why: refused in a tree config (``spec_config.translate``).
NEWER_STOCK_KEYS_TREES_SET = {
    "enable_adaptive_verification": "tree budgets are sized by 'adaptive'",
    "use_local_argmax_reduction": "tree drafting reads the drafter's whole distribution",
}


def drafts_metadata(spec_decode_metadata: Any) -> Any:
    """A step's speculative metadata, or None for a step without drafts. 0.32.0
    builds it for such steps too, and its rejection sampler fails on them under
    top-k (an empty draft set); 0.27.1 builds none. They are plain steps."""
    if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
        return None
    return spec_decode_metadata


def keep_v1_model_runner(reason: str, applies: Callable[[Any], bool]) -> None:
    """0.32.0 picks its V2 model runner by default where Triton runs (CUDA, and CPUs
    with triton-cpu); the tree runner is built on V1. For configs ``applies`` to,
    V2 is reported as not supporting ``reason``, so vLLM falls back to V1 and says
    why. ``VLLM_USE_V2_MODEL_RUNNER=1`` runs the MRV2 tree runner (``vllm_glue/mrv2``),
    for the trees ``support.check_engine`` lets through. 0.27.1 has no V2 default:
    nothing to do. Idempotent."""
    from vllm.config import VllmConfig

    original = getattr(VllmConfig, "_get_v2_model_runner_unsupported_features", None)
    if original is None or getattr(original, "_treespec_wrapped", False):
        return

    def unsupported(self) -> list[str]:
        out = original(self)
        # Asked for by name, V2 is what the engine runs (vLLM then refuses any
        # feature listed here): the MRV2 tree runner serves it, and
        # support.check_engine refuses what that runner does not serve yet.
        return out + [reason] if applies(self) and not _model_runner_v2_asked() else out

    unsupported._treespec_wrapped = True  # type: ignore[attr-defined]
    VllmConfig._get_v2_model_runner_unsupported_features = unsupported


def uses_model_runner_v2(vllm_config: Any) -> bool:
    """Whether the engine runs vLLM's Model Runner V2 (0.32.0: where asked for with
    ``VLLM_USE_V2_MODEL_RUNNER=1``, tree engines otherwise keep V1; 0.27.1 has no V2
    runner and no such property; 0.34.0 has no V1 runner, and no such property)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False)) or not _has_v1_runner()


def _has_v1_runner() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.cpu_model_runner") is not None


def mrv2_runner_site(vllm_config: Any) -> tuple[str, str] | None:
    """(module, attribute) of the MRV2 runner class the CPU worker builds in
    ``init_device``, or None where the engine runs V1. 0.32.0: vLLM's
    ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, imported by name inside
    ``CPUWorker.init_device``. 0.34.0 (read from its sources, never run here):
    ``cpu_worker.py`` imports that class at module level, so the worker module's
    own name is the one to swap."""
    if not _has_v1_runner():
        return "vllm.v1.worker.cpu_worker", "CPUModelRunner"
    if uses_model_runner_v2(vllm_config):
        return "vllm.v1.worker.cpu.model_runner", "CPUModelRunner"
    return None


def _model_runner_v2_asked() -> bool:
    """``VLLM_USE_V2_MODEL_RUNNER`` set true (vLLM's reading of it)."""
    from vllm import envs

    return bool(envs.VLLM_USE_V2_MODEL_RUNNER)


def grammar_constrains_next(manager: Any, request: Any) -> bool:
    """Whether ``request``'s grammar masks its next token (``StructuredOutputManager``
    ``manager``): always, unless a reasoning parser holds it off until the
    thinking part ends. 0.32.0 reads that off ``_get_constraint_bounds`` (the
    grammar starts at the first token: bounds (0, 0)); 0.27.1 off
    ``should_fill_bitmask``."""
    bounds = getattr(manager, "_get_constraint_bounds", None)
    if bounds is not None:
        return tuple(bounds(request, ())) == (0, 0)
    return bool(manager.should_fill_bitmask(request))


def compile_request_grammar(backend: Any, params: Any) -> Any:
    """The grammar of a request with ``params`` (its ``SamplingParams``), compiled
    by ``backend`` (vLLM's ``XgrammarBackend``) as vLLM's scheduler compiles it
    (``StructuredOutputManager._create_grammar``): 0.32.0 passes the request's
    stop tokens, which end the grammar's accepted strings; 0.27.1 has no such
    argument."""
    import inspect

    from vllm.v1.structured_output.request import get_structured_output_key

    request_type, spec = get_structured_output_key(params.structured_outputs)
    if "stop_token_ids" in inspect.signature(backend.compile_grammar).parameters:
        return backend.compile_grammar(request_type, spec,
                                       stop_token_ids=params.all_stop_token_ids)
    return backend.compile_grammar(request_type, spec)
