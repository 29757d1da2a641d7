"""Tree attention: one interface, one implementation per device.

Every backend computes the same function (see ``reference``): attention of the
verify queries over a paged KV cache where tree rows follow an ancestor-or-self
mask and all other rows are causal. The reference implementation is the oracle
the device paths are tested against and the eager fallback on any device.
"""

from vllm_treespec.attention import cpu_layout
from vllm_treespec.attention.metadata import (
    DraftTreeLevelMetadata,
    PagedTreeAttentionMetadata,
    TreeVerifyRows,
)
from vllm_treespec.attention.reference import (
    attention_mask,
    gather_paged_kv,
    paged_tree_attention,
    prefix_side_attention,
)

__all__ = ["cpu_layout", "DraftTreeLevelMetadata", "TreeVerifyRows",
           "PagedTreeAttentionMetadata", "attention_mask", "gather_paged_kv",
           "paged_tree_attention", "prefix_side_attention"]
