"""Serving a ``speculators``-format EAGLE-3 head as the model, with trees.

``vllm serve HEAD --speculative-config '{"method": "eagle3_tree"}'`` names a head
in the ``speculators`` format (``speculators_config`` in its config.json, e.g. the
RedHatAI ``*-speculator.eagle3`` heads) as the served model. Before the model
config is built, vLLM's ``maybe_override_with_speculators`` swaps in the head's
verifier as the model and builds the speculative config from the head; vLLM 0.32.0
then locks ``method`` to the head's own (``eagle3``) after merging the user's
dict, and 0.27.1 ignores the user's dict altogether. Either way a tree request
would be served as stock ``eagle3`` chains without a word, or (tree keys present)
fail with pydantic's "extra fields" error.

For a tree request (``method`` ``eagle3_tree``, in the JSON form or the
``--spec-*`` flags) the override here keeps the user's method: the verifier is
served as the model, the head as the drafter, and the tree path
(``spec_config``) translates the rest as for any other head. The head's own
settings reach the drafter through vLLM's speculators config conversion (the
draft ``hf_config`` vLLM's EAGLE-3 model reads); ``check_served_head`` refuses
an engine whose draft config lost one of them. Stock methods, and models that
are not speculators checkpoints, go through vLLM unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_treespec.config import TreeSpecConfigError

METHOD = "eagle3_tree"
# speculators_model_type values a tree can draft with: one EAGLE-3 decoder layer
# drafting one token per forward (PEAGLE / DFlash heads draft differently).
TREE_TYPES = ("eagle3",)
# Head settings that change what the drafter computes. Each one present in the
# head's config.json must reach the draft hf_config vLLM's EAGLE-3 model reads.
HEAD_KEYS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
             "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size")

logger = logging.getLogger("vllm.treespec")


def _refuse(head: str, key: str, value: Any, allowed: str) -> TreeSpecConfigError:
    return TreeSpecConfigError(
        f"{METHOD}: speculators-format head {head!r} served as the model: {key} has "
        f"value {value!r}; allowed: {allowed}")


def checkpoint_dict(model: str, revision: str | None = None,
                    hf_token: bool | str | None = None) -> dict[str, Any] | None:
    """The config.json of ``model`` as vLLM's override reads it (local directory or
    hub cache; offline when ``HF_HUB_OFFLINE``), or None when it cannot be read
    (vLLM then reports that itself)."""
    import huggingface_hub
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(
            model, revision=revision, token=hf_token,
            local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)
    except (OSError, ValueError):
        return None
    return config


def tree_speculative_config(head: str, config: dict[str, Any],
                            user: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(verifier, speculative config) for serving the speculators head ``head``
    (its config.json as ``config``) with the user's tree config ``user``."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    kind = config.get("speculators_model_type")
    if kind not in TREE_TYPES:
        raise _refuse(head, "speculators_model_type", kind,
                      f"one of {list(TREE_TYPES)} (heads that draft one token per forward; "
                      f"serve this one with vLLM's own method for it)")
    # vLLM's reader: validates the structure and gives the stock speculative config.
    stock = SpeculatorsConfig.extract_vllm_speculative_config(config_dict=config)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get(
        "name_or_path")
    if not verifier:
        raise _refuse(head, "speculators_config.verifier.name_or_path", verifier,
                      "the target model's path or hub id (or serve the target as the "
                      "model and name this head in the speculative-config 'model')")
    user = {k.replace("-", "_"): v for k, v in user.items()}
    if user.get("model") not in (None, head):
        raise _refuse(head, "speculative-config key 'model'", user["model"],
                      f"leave it out, or {head!r} (the served head is the drafter)")
    # The head's chain length is no tree setting (translate refuses the key):
    # trees are sized by num_nodes.
    chain = stock.pop("num_speculative_tokens", None)
    merged = {**stock, **user, "method": METHOD, "model": head}
    logger.info("%s: %s is a speculators-format EAGLE-3 head of %s: serving trees with it "
                "(its chain length of %s tokens is not used; num_nodes sizes the trees)",
                METHOD, head, verifier, chain)
    return verifier, merged


def _override(original):
    def maybe_override_with_speculators(model, tokenizer, trust_remote_code, revision=None,
                                        vllm_speculative_config=None, hf_token=None,
                                        **kwargs):
        user = vllm_speculative_config
        if isinstance(user, dict) and user.get("method") == METHOD:
            config = checkpoint_dict(model, revision, hf_token)
            if config is not None and config.get("speculators_config") is not None:
                verifier, merged = tree_speculative_config(model, config, user)
                return verifier, verifier, merged
        return original(model, tokenizer, trust_remote_code, revision=revision,
                        vllm_speculative_config=vllm_speculative_config,
                        hf_token=hf_token, **kwargs)

    maybe_override_with_speculators._treespec_wrapped = True  # type: ignore[attr-defined]
    return maybe_override_with_speculators


def check_head_config(head: str, config: dict[str, Any], hf_config: Any) -> None:
    """Every drafting setting of the speculators head ``head`` (config.json as
    ``config``) is in the draft ``hf_config`` vLLM built: the EAGLE-3 model reads
    them there, and one lost in conversion would draft with another function
    than the head was trained for (only low acceptance would show it)."""
    for key in HEAD_KEYS:
        want = config.get(key)
        got = getattr(hf_config, key, None)
        if want is None or (list(got) if isinstance(got, tuple) else got) == want:
            continue
        raise TreeSpecConfigError(
            f"{METHOD}: speculators-format head {head!r}: {key} has value {want!r} in its "
            f"config.json, but vLLM's converted draft config carries {got!r}; allowed: a "
            f"vLLM whose speculators conversion keeps {key!r} (the supported releases do)")


def check_served_head(vllm_config: Any, hf_token: bool | str | None = None) -> None:
    """``check_head_config`` for a tree engine's drafter, when it is a speculators head."""
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    if draft is None:
        return
    config = checkpoint_dict(draft.model, getattr(draft, "revision", None), hf_token)
    if config is not None and config.get("speculators_config") is not None:
        check_head_config(draft.model, config, draft.hf_config)


def patch_speculators_override() -> None:
    """Wrap vLLM's speculators override where ``EngineArgs.create_engine_config``
    calls it (``arg_utils`` imported the function by name), and
    ``create_engine_config`` itself (idempotent)."""
    from vllm.engine import arg_utils

    from vllm_treespec.vllm_glue.spec_config import _spec_dict, tree_config_from_vllm

    original = getattr(arg_utils, "maybe_override_with_speculators", None)
    if original is None or getattr(original, "_treespec_wrapped", False):
        return
    arg_utils.maybe_override_with_speculators = _override(original)
    inner = arg_utils.EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        # vLLM merges the --spec-* flags only after the override has run: merged
        # here, a tree asked for by flags is seen by the override too.
        _spec_dict(self)
        config = inner(self, *args, **kwargs)
        if tree_config_from_vllm(config) is not None:
            check_served_head(config, getattr(self, "hf_token", None))
        return config

    arg_utils.EngineArgs.create_engine_config = create_engine_config
