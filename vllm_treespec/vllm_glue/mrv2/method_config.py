"""``eagle3_tree``'s ``SpeculatorConfig`` for vLLM 0.34+ (``registration``).

Imported only by vLLM, through the qualified name ``registration`` registers, when
a speculative config names ``eagle3_tree``: it subclasses 0.34's EAGLE-3 config,
which older releases do not have. As vLLM asks of config modules, it does not import
the speculator (it is used in every process): ``speculator_class`` is a name that
vLLM's ``init_speculator`` resolves in the worker.

Subclassing ``Eagle3SpeculatorConfig`` keeps everything vLLM derives from EAGLE-3:
``base_method`` stays ``eagle3`` (vLLM sets ``SpeculativeConfig.method`` to it, so every
``eagle3`` path applies: the draft config wrapped as an EAGLE config, the target's aux
hidden states, ``num_lookahead_tokens`` = ``num_speculative_tokens`` = the node
budget). What differs: the speculator class, the tree keys as ``speculator_options``
(validated here), and no watermarking (tree drafts are the drafter's top-k, not
draws vLLM's draft watermarker could key)."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.spec_decode.eagle.config import Eagle3SpeculatorConfig

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.vllm_glue.mrv2.registration import SPECULATOR_CLASS


class TreeEagle3SpeculatorConfig(Eagle3SpeculatorConfig):
    speculator_class = SPECULATOR_CLASS
    supported_options = Eagle3SpeculatorConfig.supported_options | {"speculator_options"}
    supports_watermarking = False

    @classmethod
    def apply_options(cls, spec: Any) -> None:
        super().apply_options(spec)
        tree_options(spec)


def tree_options(spec: Any) -> TreeSpecConfig:
    """The tree keys of a ``SpeculativeConfig`` naming ``eagle3_tree`` (its
    ``speculator_options``), checked against its draft budget. The plugin's
    engine-args translation puts them there (``registration.as_registered_method``)."""
    raw = getattr(spec, "speculator_options", None)
    if raw is None:
        raise TreeSpecConfigError(
            "eagle3_tree: the speculative config has no 'speculator_options'; the tree "
            "keys reach vLLM through the vllm-treespec plugin's engine-args translation "
            "(--speculative-config '{\"method\": \"eagle3_tree\", ...}')")
    tree = TreeSpecConfig.from_dict(raw)
    if spec.num_speculative_tokens != tree.num_nodes:
        raise TreeSpecConfigError(
            f"eagle3_tree: 'num_speculative_tokens' has invalid value "
            f"{spec.num_speculative_tokens!r}; allowed: the node budget 'num_nodes' "
            f"({tree.num_nodes}), which the plugin sets")
    return tree
