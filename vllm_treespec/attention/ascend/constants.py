"""Constants shared by several modules of the Ascend tree attention.

Owns: the KV block size vllm-ascend's kernels use and the names of the fused
variants (``full_mask``, ``two_pass``, ``tree_sparse``, and ``triton``: our own Triton
kernel, ``vllm_treespec.kernels.tree_attention``; see the package overview).
Imports nothing from the package: it is the bottom of the dependency order.
"""

ASCEND_BLOCK_SIZE = 128          # vllm-ascend's only kernel block size

FULL_MASK = "full_mask"
TWO_PASS = "two_pass"
TREE_SPARSE = "tree_sparse"
TRITON = "triton"
VARIANTS = (FULL_MASK, TWO_PASS, TREE_SPARSE, TRITON)
