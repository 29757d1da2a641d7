"""One verify step's tree requests, as every stage of the engine sees them."""

from __future__ import annotations

import dataclasses

import torch

from vllm_treespec.tree import TreeBatch


@dataclasses.dataclass
class VerifyStep:
    """Tree requests of one verify step (batch order), filled by a runner adapter."""

    req_index: torch.Tensor      # [Bt] batch rows that carry a tree
    tree: TreeBatch              # [Bt, T]
    prefix_len: torch.Tensor     # [Bt] position of each root (= tokens before it)
    token_start: torch.Tensor    # [Bt] flat query index of each root (its drafts follow)
    logit_start: torch.Tensor    # [Bt] logits row of each root
    num_reqs: int
    # Per tree, per draft node: its draft probability (the product along its path).
    draft_probs: list[list[float]] | None = None
    # The ProposedTree of each tree (its sources and copy branches, if any).
    proposed: list | None = None
    depth: int = 0               # drafting depth that produced these trees
    prepare_s: float = 0.0       # tensorize + positions + attention metadata
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    # [Bt, T, W] int32 grammar bitmask per node (``engine.grammar``: the tokens the
    # grammar allows after the node's path; every bit set for a tree without one);
    # None where no tree of the step is under a grammar.
    grammar_masks: torch.Tensor | None = None

    @property
    def predicted(self) -> float:
        """Drafts the proposer expects accepted: the verified nodes' probabilities, summed."""
        return float(sum(sum(p) for p in self.draft_probs or ()))

    def node_tokens(self) -> torch.Tensor:
        """[Bt, T] flat query index of every node (read through ``tree.valid``)."""
        return self.token_start.unsqueeze(1) + self.tree.node_index


def node_rows(step: VerifyStep) -> torch.Tensor:
    """[Bt, T] logits row of every node (padding nodes read the root's row)."""
    T = step.tree.tree_size
    offs = torch.arange(T, device=step.logit_start.device).unsqueeze(0)
    offs = torch.where(step.tree.valid, offs, torch.zeros_like(offs))
    return step.logit_start.unsqueeze(1) + offs
