"""Pure tensor tree algorithms (no vLLM import): shared by every device path."""

from vllm_treespec.tree.accept import (
    PAD_TOKEN_ID,
    Acceptance,
    CompactionPlan,
    Outcome,
    apply_compaction,
    compaction_plan,
    greedy_accept,
    samples_on_path,
    stochastic_accept,
)
from vllm_treespec.tree.build import DynamicTreeBuilder, Level
from vllm_treespec.tree.mask import tree_mask
from vllm_treespec.tree.nucleus import sample_rows, top_k_top_p_probs
from vllm_treespec.tree.penalties import path_tokens, penalise_rows
from vllm_treespec.tree.static import StaticTopology, StaticTreeBuilder
from vllm_treespec.tree.tensorize import TreeBatch, TreeInvariantError

__all__ = [
    "PAD_TOKEN_ID", "Acceptance", "CompactionPlan", "DynamicTreeBuilder", "Level", "Outcome",
    "StaticTopology", "StaticTreeBuilder", "TreeBatch", "TreeInvariantError",
    "apply_compaction", "compaction_plan", "greedy_accept", "path_tokens", "penalise_rows",
    "samples_on_path", "sample_rows", "stochastic_accept",
    "top_k_top_p_probs", "tree_mask",
]
