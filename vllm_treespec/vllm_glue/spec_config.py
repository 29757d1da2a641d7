"""``--speculative-config '{"method": "eagle3_tree", ...}'`` -> stock vLLM config.

vLLM validates ``SpeculativeConfig.method`` against a closed list and keys ~10
code paths (aux hidden states, lookahead slots, the drafter class) off
``"eagle3"``. So the tree method is translated where the user's dict enters
vLLM (``EngineArgs.create_speculative_config``):

* the tree keys are validated (``TreeSpecConfig``) and moved to
  ``additional_config["eagle3_tree"]``, which reaches every process and is part
  of the config hash;
* the rest runs through the stock ``eagle3`` path (where vLLM registered the
  method, 0.34+: named ``eagle3_tree``, tree keys as ``speculator_options``,
  ``mrv2.registration``; vLLM then sets ``method`` to ``eagle3`` itself) with
  ``num_speculative_tokens`` = the node budget, so vLLM allocates KV slots and
  schedules up to ``num_nodes`` draft tokens per request;
* scheduling is made synchronous: acceptance, KV commit and drafting read the
  accepted path on the host between steps;
* the finished engine config is checked for setups trees would get wrong
  (``support.check_engine``).

Errors are raised here, in the API server / ``LLM`` process, before any model
is loaded.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.vllm_glue import support, versions
from vllm_treespec.vllm_glue.mrv2 import registration

METHOD = "eagle3_tree"
ADDITIONAL_CONFIG_KEY = "eagle3_tree"
# Set where the frontend records the tree stat logger (pyproject's entry-point name).
FRONTEND_STATS_KEY = "eagle3_tree_frontend_stats"
STAT_LOGGER_PLUGIN = "treespec"

logger = logging.getLogger("vllm.treespec")

# Stock keys that make no sense with a tree (the tree sets them itself).
_FORBIDDEN_STOCK_KEYS = {
    "num_speculative_tokens": "use 'num_nodes' (the node budget) instead",
    "parallel_drafting": "tree drafting expands level by level",
    "disable_padded_drafter_batch": "the tree drafter always uses the padded batch",
    "draft_sample_method": "tree drafts are the drafter's top-k; acceptance is lossless",
    "rejection_sample_method": "tree acceptance has its own lossless rule",
    "num_speculative_tokens_per_batch_size": "tree budgets are set by 'num_nodes'",
    **versions.NEWER_STOCK_KEYS_TREES_SET,
}


def translate(spec: dict[str, Any], stock_keys: set[str] | None = None
              ) -> tuple[dict[str, Any], TreeSpecConfig]:
    """Split a user speculative-config dict into (stock eagle3 dict, tree config).

    ``stock_keys``: the fields vLLM's SpeculativeConfig accepts; any other key that
    is not a tree key is reported here, with both lists, rather than by pydantic.
    """
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    if spec.get("method") != METHOD:
        raise ValueError(f"not an {METHOD} config")
    for key, why in _FORBIDDEN_STOCK_KEYS.items():
        if key in spec:
            raise TreeSpecConfigError(
                f"{METHOD}: speculative-config key {key!r} has invalid value "
                f"{spec[key]!r}; allowed: leave it out ({why})")
    if not spec.get("model"):
        raise TreeSpecConfigError(
            f"{METHOD}: speculative-config key 'model' has invalid value "
            f"{spec.get('model')!r}; allowed: the path or name of an EAGLE-3 drafter")
    if stock_keys is not None:
        unknown = sorted(k for k in spec if k not in stock_keys and k not in TreeSpecConfig.keys())
        if unknown:
            raise TreeSpecConfigError(
                f"{METHOD}: unknown speculative-config key(s) {unknown}; tree keys are "
                f"{list(TreeSpecConfig.keys())}, plus vLLM's speculative-config keys "
                f"(e.g. 'model', 'draft_tensor_parallel_size', 'max_model_len')")
    tree_raw = {k: spec.pop(k) for k in list(spec) if k in TreeSpecConfig.keys()}
    tree = TreeSpecConfig.from_dict(tree_raw)
    stock = dict(spec, method="eagle3", num_speculative_tokens=tree.num_nodes)
    return stock, tree


def tree_config_from_vllm(vllm_config: Any) -> TreeSpecConfig | None:
    """The tree settings of a running engine, or None when not in tree mode.

    ``translate`` validated them where the user's dict entered vLLM; every other
    process reads them from the engine config (``additional_config``). Each
    distinct setting is parsed once per process and the same frozen object is
    handed to every consumer (runner, proposer, scheduler, backends, stat logger)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    if raw is None:
        return None
    key = json.dumps(raw, sort_keys=True)
    if key not in _PARSED:
        _PARSED[key] = TreeSpecConfig.from_dict(raw)
    return _PARSED[key]


_PARSED: dict[str, TreeSpecConfig] = {}  # tree_config_from_vllm's, by the stored dict


WORKERS = {
    "cpu": "vllm_treespec.vllm_glue.workers.TreeCPUWorker",
    # vllm-ascend's NPUPlatform.device_type; the class lives with the Ascend glue so
    # that NPU workers never import vLLM's CPU worker module (and CPU ones never torch_npu)
    "npu": "vllm_treespec.vllm_glue.ascend.worker.TreeNPUWorker",
}


def _stock_keys() -> set[str]:
    import dataclasses

    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def _platform_kind() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else getattr(current_platform, "device_type", "?")


def _select_worker(parallel_config: Any, kind: str | None = None,
                   environ: dict[str, str] | None = None) -> None:
    """Point the engine at this platform's tree worker (stock runner + tree mixin)."""
    from vllm_treespec.attention.ascend.settings import requested_settings

    kind = kind or _platform_kind()
    environ = os.environ if environ is None else environ
    if kind not in WORKERS:
        raise TreeSpecConfigError(
            f"{METHOD}: platform {kind!r} is not supported by this version; "
            f"supported: {sorted(WORKERS)}")
    asked = requested_settings(environ)
    if kind != "npu" and asked:
        # Served anyway, these would be ignored: say so rather than run another path.
        raise TreeSpecConfigError(
            f"{METHOD}: {', '.join(asked)} asks for Ascend tree attention, but vLLM runs "
            f"on platform {kind!r} (no torch_npu / vllm-ascend platform found); allowed: "
            f"unset it, or serve on an Ascend install")
    current = getattr(parallel_config, "worker_cls", "auto")
    if current not in ("auto", WORKERS[kind]):
        raise TreeSpecConfigError(
            f"{METHOD}: engine argument 'worker_cls' has invalid value {current!r}; "
            f"allowed: 'auto' (the tree worker {WORKERS[kind]} is selected automatically)")
    parallel_config.worker_cls = WORKERS[kind]


def _frontend_loads_stat_logger(engine_args: Any) -> bool:
    """Whether the engine's frontend records the tree stat logger, which takes the
    tree counters out of each step's stats (``stats_channel``): vLLM's server
    (``AsyncLLM``, built from ``AsyncEngineArgs``) loads stat-logger plugins, the
    offline ``LLMEngine`` does not, and ``VLLM_PLUGINS`` may leave ours out (or
    it may fail to load: vLLM logs that and goes on). Any other frontend must
    not get them: vLLM's own logger fails on them."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP, load_plugins_by_group

    return isinstance(engine_args, AsyncEngineArgs) and (
        STAT_LOGGER_PLUGIN in load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP))


def frontend_takes_stats(vllm_config: Any) -> bool:
    """Whether this engine's workers send tree counters with their step outputs."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return isinstance(extra, dict) and bool(extra.get(FRONTEND_STATS_KEY))


def _spec_dict(engine_args: Any) -> dict[str, Any] | None:
    """The speculative config as vLLM will see it: the JSON form, or the
    ``--spec-method`` / ``--spec-model`` / ``--spec-tokens`` flags merged in
    (vLLM merges them inside ``create_speculative_config``; a tree must be
    recognised before that). Stock configs are left for vLLM to merge."""
    spec = engine_args.speculative_config
    flags = {key: getattr(engine_args, flag, None) for flag, key in (
        ("spec_method", "method"), ("spec_model", "model"),
        ("spec_tokens", "num_speculative_tokens"))}
    flags = {k: v for k, v in flags.items() if v is not None}
    if not flags or (flags.get("method") or (spec or {}).get("method")) != METHOD:
        return spec
    both = sorted(set(flags) & set(spec or {}))
    if both:
        raise TreeSpecConfigError(
            f"{METHOD}: {both} given both as --spec-* flags and in --speculative-config; "
            f"allowed: one of the two")
    spec = dict(spec or {}, **flags)
    engine_args.speculative_config = spec
    engine_args.spec_method = engine_args.spec_model = engine_args.spec_tokens = None
    return spec


def patch_model_runner_choice() -> None:
    """Tree engines run vLLM's V1 model runner (``versions.keep_v1_model_runner``)."""
    versions.keep_v1_model_runner(f"speculative method '{METHOD}'",
                                  lambda config: tree_config_from_vllm(config) is not None)


def check_resolved_drafter(vllm_config: Any, tree: TreeSpecConfig) -> None:
    """The drafter's config as vLLM resolved it (the draft ``hf_config``, before any
    process loads weights) fits the target. This is the check a head named by hub id
    gets (``support.check_drafter`` reads local config.json files only, when the
    speculative config is made); a local head gets it again, on the config vLLM
    will build the drafter from (a redirected or downloaded model path too)."""
    draft = vllm_config.speculative_config.draft_model_config
    support.check_drafter_config(
        draft.model, draft.hf_config.to_dict(), vllm_config.model_config.hf_text_config,
        parallel_depth=tree.depth if tree.draft == "parallel" else None)


def patch_engine_args() -> None:
    """Wrap ``EngineArgs.create_speculative_config`` and ``create_engine_config``
    (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_treespec_wrapped", False):
        return

    def create_speculative_config(self, *args, **kwargs):
        spec = _spec_dict(self)
        if isinstance(spec, dict) and spec.get("method") == METHOD:
            support.check_vllm_version(versions.installed_release())
            keys = _stock_keys()
            stock, tree = translate(spec, keys)
            versions.switch_block_drop_off(stock, keys)  # prefix hits kept whole
            target = kwargs.get("target_model_config", args[0] if args else None)
            support.check_drafter(str(stock["model"]), target.hf_text_config,
                                  parallel_depth=tree.depth if tree.draft == "parallel" else None)
            if getattr(self, "async_scheduling", None):
                raise TreeSpecConfigError(
                    f"{METHOD}: engine argument 'async_scheduling' has invalid value "
                    f"True; allowed: False or unset (tree verification commits the "
                    f"accepted path before the next step is scheduled)")
            self.async_scheduling = False
            parallel = kwargs.get("target_parallel_config", args[1] if len(args) > 1 else None)
            _select_worker(parallel)
            extra = dict(self.additional_config or {})
            extra[ADDITIONAL_CONFIG_KEY] = tree.to_dict()
            extra[FRONTEND_STATS_KEY] = _frontend_loads_stat_logger(self)
            self.additional_config = extra
            if registration.registered():  # vLLM 0.34+: the method by its own name
                stock = registration.as_registered_method(stock, extra[ADDITIONAL_CONFIG_KEY])
            self.speculative_config = stock
            logger.info("%s: %s", METHOD, tree)
        return original(self, *args, **kwargs)

    original_engine = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original_engine(self, *args, **kwargs)
        tree = tree_config_from_vllm(config)
        if tree is not None:
            support.check_engine(config, tree.num_nodes)
            check_resolved_drafter(config, tree)
        return config

    create_speculative_config._treespec_wrapped = True  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config
    EngineArgs.create_engine_config = create_engine_config
