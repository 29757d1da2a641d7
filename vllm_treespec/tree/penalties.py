"""Repetition, frequency and presence penalties for every node of a batch of
trees, with vLLM's semantics (``apply_penalties``), at the tokens they change.

vLLM's op builds [rows, vocab] count and mask tensors for every row it is given
and makes several passes over [rows, vocab]: one row per request on a plain step,
but a row per node on a tree step, which for 100 trees of 13 nodes took over
ten times as long as penalising only the tokens they change
(``bench/tree_step_costs.py --part penalties``;
benchmarks/history/RESULTS-history.md, "Penalties on tree nodes at the tokens
they change (2026-12-01, AVX-512 machine): a step's acceptance 1.9 s -> 0.4 s
in a mixed batch of 100 trees"). A penalty changes only the logits of tokens in
a row's prompt or output (for a node: the request's output plus the node's path), so
``penalise_rows`` gathers those, applies vLLM's float32 arithmetic, and writes
them back: elsewhere vLLM's op multiplies by 1 and subtracts 0.
"""

from __future__ import annotations

import torch

from vllm_treespec.tree.tensorize import TreeBatch


def path_tokens(tree: TreeBatch, pad: int) -> torch.Tensor:
    """[B, T, D] token ids of each node's path below the root, the node last;
    ``pad`` past the node's depth."""
    anc = tree.ancestors[:, :, 1:]  # entry d - 1: the ancestor at depth d
    B, T, D = anc.shape
    tokens = torch.gather(tree.token, 1, anc.reshape(B, T * D)).view(B, T, D)
    beyond = torch.arange(1, D + 1, device=anc.device) > tree.depth.unsqueeze(-1)
    return tokens.masked_fill(beyond, pad)


def penalise_rows(x: torch.Tensor, rows: torch.Tensor, prompt: torch.Tensor,
                  outputs: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor) -> None:
    """vLLM's ``apply_penalties`` on rows ``rows`` of ``x`` [N, V], in place.

    prompt [R, Lp] and outputs [R, Lo]: each row's token ids, padded with V
    (outputs may hold -1 too, which vLLM also ignores); repetition, frequency,
    presence [R]. Each row's distinct tokens are found with one ``unique`` over
    (row, token) keys; their logits get ``x * (1 / r)`` (x > 0) or ``x * r``, then
    ``- f * count`` and, where the output holds the token, ``- p``: vLLM's op and
    its float32 arithmetic, so results match it bit for bit.
    """
    V = x.shape[1]
    dev = x.device
    outputs = outputs.masked_fill(outputs < 0, V)
    ids = torch.cat([prompt.long(), outputs.long()], dim=1)  # [R, K]
    from_output = torch.zeros(ids.shape, dtype=torch.float32, device=dev)
    from_output[:, prompt.shape[1]:] = 1.0
    keys = torch.arange(rows.numel(), device=dev).unsqueeze(1) * (V + 1) + ids
    unique, inverse = torch.unique(keys.reshape(-1), return_inverse=True)
    count = torch.zeros(unique.numel(), device=dev).index_add_(0, inverse,
                                                               from_output.reshape(-1))
    row, token = unique // (V + 1), unique % (V + 1)
    real = token < V  # padding is not a token
    row, token, count = row[real], token[real], count[real]
    flat = x.view(-1)
    at = rows.long()[row] * V + token
    v = flat[at]
    r = repetition[row]
    v = v * torch.where(v > 0, 1.0 / r, r)
    v = v - frequency[row] * count
    v = v - presence[row] * (count > 0).float()
    flat[at] = v
