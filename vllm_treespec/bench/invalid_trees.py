"""The soak's injected fault (``--invalid-trees N``), kept out of the serving path.

The fault server is started with ``--worker-extension-cls`` naming
:class:`InvalidTrees`; vLLM imports this module in each of its workers to mix
that (empty) class in, and the import arms the fault there: every N-th
validated batch of draft trees (``$VLLM_TREESPEC_TEST_INVALID_TREE_EVERY``)
comes back with the first draft node of its first drafting request given token
-1, which ``validate_invariants`` must catch. Nothing of this runs in a server
started without that flag.
"""

from __future__ import annotations

import dataclasses
import os

INVALID_TREE_ENV = "VLLM_TREESPEC_TEST_INVALID_TREE_EVERY"
WORKER_EXTENSION = f"{__name__}.InvalidTrees"


class InvalidTreeInjector:
    """Every ``every``-th call returns its trees with one impossible token."""

    def __init__(self, every: int) -> None:
        self.every, self.calls = every, 0

    def __call__(self, trees):
        self.calls += 1
        drafting = (trees.node_counts > 0).nonzero()
        if self.calls % self.every or drafting.numel() == 0:
            return trees
        token = trees.token.clone()
        token[int(drafting[0]), 1] = -1
        return dataclasses.replace(trees, token=token)


class InvalidTrees:
    """The worker extension whose import arms the fault (it adds no methods)."""


def _arm() -> None:
    every = os.environ.get(INVALID_TREE_ENV, "")
    if not every.isdigit() or not int(every):
        return
    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    checked = TreeEagleProposer.checked_trees
    inject = InvalidTreeInjector(int(every))

    def checked_with_fault(self, trees, prefix_len, rows=None):
        return checked(self, inject(trees), prefix_len, rows)

    TreeEagleProposer.checked_trees = checked_with_fault


_arm()
