"""`vllm-treespec check TARGET DRAFTER`: what `eagle3_tree` will do with a model pair here.

Reads configs only (local directories, or a hub id as vLLM resolves it: from
the hub cache, or the hub itself unless ``HF_HUB_OFFLINE=1``); no weights load.
The verdict is the startup's own: vLLM's ``EngineArgs.create_engine_config``
runs with the plugin registered, so every check a server runs before loading
(the tree keys, the drafter against the target, engine features, parallelism)
is the same code, not a copy. Then the attention-layer checks (``support.
check_attention_layer``) run on what the target's config says its layers are;
a layer feature no config field names (ALiBi, attention sinks) is refused when
the server builds the layers, before any weight loads.

Prints "served" with the pair's layout (the head's format, the target layers it
reads, its vocabulary map, the tree settings), or "refused" and why.
Exit status 0 when served, 1 when refused.

    vllm-treespec check Qwen/Qwen3-8B ./qwen3-8b-eagle3 \\
        --speculative-config '{"num_nodes": 16}' --engine-args '{"max_model_len": 4096}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-treespec check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="the served model: a directory or a hub id")
    p.add_argument("drafter", help="the EAGLE-3 head: a directory or a hub id")
    p.add_argument("--speculative-config", type=_json_object, default={},
                   help="more speculative-config keys (tree keys, vLLM's), as served")
    p.add_argument("--engine-args", type=_json_object, default={},
                   help="engine arguments as served, e.g. {\"tensor_parallel_size\": 2}")
    return p


def layer_features(model_config: Any, cache_dtype: str) -> dict[str, Any]:
    """``check_attention_layer``'s arguments as the target's config gives them."""
    hf = model_config.hf_text_config
    return {"sliding_window": model_config.get_sliding_window(),
            "alibi_slopes": None, "sinks": None,  # no config field: checked per layer
            "logits_soft_cap": getattr(hf, "attn_logit_softcapping", None),
            "kv_cache_dtype": cache_dtype}


def verdict(target: str, drafter: str, spec: dict, engine_args: dict) -> list[str]:
    """The lines ``check`` prints for a pair that is served; raises
    ``TreeSpecConfigError`` (or vLLM's own error) for one that is not."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_treespec
    from vllm_treespec.vllm_glue import support
    from vllm_treespec.vllm_glue.drafter_checks import describe_head
    from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

    vllm_treespec.register()  # as vLLM's plugin loader does in every process
    config = EngineArgs(model=target, **engine_args,
                        speculative_config=dict(spec, method="eagle3_tree",
                                                model=drafter)).create_engine_config()
    model = config.model_config
    support.check_attention_layer(**layer_features(model, config.cache_config.cache_dtype))
    draft = config.speculative_config.draft_model_config
    local = Path(drafter).expanduser() / "config.json"
    raw = json.loads(local.read_text()) if local.is_file() else draft.hf_config.to_dict()
    tree = tree_config_from_vllm(config)
    parallel = config.parallel_config
    return [f"target: {(model.architectures or ['?'])[0]} (model_type "
            f"{model.hf_config.model_type!r}), {model.hf_text_config.num_hidden_layers} "
            f"layers, hidden size {model.get_hidden_size()}, dtype {model.dtype}",
            *describe_head(draft.model, raw, model.hf_text_config),
            f"trees: {tree}",
            f"runs on: {config.device_config.device_type}, tensor parallel "
            f"{parallel.tensor_parallel_size}, worker {parallel.worker_cls}"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # vLLM's info lines (architecture resolved, defaults chosen) before the verdict
    # are noise here; set the variable to see them. Restored after: a caller in the
    # same process (a test, a script) starts servers that inherit the environment.
    with _quiet_vllm():
        return _report(args)


@contextlib.contextmanager
def _quiet_vllm():
    if "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    try:
        yield
    finally:
        del os.environ["VLLM_LOGGING_LEVEL"]


def _report(args: argparse.Namespace) -> int:
    from vllm_treespec.config import TreeSpecConfigError

    try:
        lines = verdict(args.target, args.drafter, args.speculative_config, args.engine_args)
    except TreeSpecConfigError as e:
        print(f"refused: {e}")
        return 1
    except (ValueError, OSError) as e:  # vLLM's own: the pair cannot be served at all
        print(f"refused by vLLM: {type(e).__name__}: {e}")
        return 1
    print("served: every startup check that reads configs passed (the weights are "
          "checked as they load)")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
