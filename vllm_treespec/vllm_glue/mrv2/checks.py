"""What this MRV2 slice serves, refused by name otherwise (before any model loads:
``support.check_engine``; again where the runner is built)."""

from __future__ import annotations

import os

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.vllm_glue.mrv2.trees import fits


# The MRV2 slice is a preview run by the MRV2 test lane: fixed trees only, and
# requests with parameters V1 serves without a tree (penalties, logit bias, logprobs,
# grammars...) are refused there (``requests``), so it runs only when asked for by name.
PREVIEW = "VLLM_TREESPEC_MRV2_PREVIEW"


def check_mrv2_tree(tree: TreeSpecConfig | None) -> None:
    if os.environ.get(PREVIEW) != "1":
        raise TreeSpecConfigError(
            "eagle3_tree on vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) is a preview "
            "for its test lane: fixed trees only, and requests with penalties, min-p at "
            "temperature > 0, logit bias, allowed token ids, bad words, min tokens, structured "
            f"output or logprobs are refused (400). Set {PREVIEW}=1 to run it (docs/mrv2.md), "
            "or VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner")
    if tree is None:
        raise TreeSpecConfigError("eagle3_tree on MRV2: no tree configuration found")
    refused = []
    if tree.adaptive:
        refused.append("'adaptive': true (set false: a fixed tree)")
    if tree.choices is not None:
        refused.append("'choices' (static topologies)")
    if tree.draft != "sequential":
        refused.append(f"'draft': {tree.draft!r}")
    if tree.copy_branches or tree.cross_request_tokens:
        refused.append("copy branches ('copy_branches': 0, 'cross_request_tokens': 0)")
    if not fits(tree.num_nodes, tree.depth, tree.top_k):
        refused.append(f"'num_nodes' {tree.num_nodes} > depth {tree.depth} x top_k "
                       f"{tree.top_k} (the nodes every dynamic tree has: MRV2 verifies "
                       f"a fixed draft count)")
    if refused:
        raise TreeSpecConfigError(
            "eagle3_tree on vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) serves "
            "fixed trees only so far; not supported there: " + "; ".join(refused)
            + " (docs/mrv2.md; or VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner)")
