"""Which draft nodes a step verifies, across the whole batch: the EAGLE-2
rerank generalised to a batch under a cost model.

Every candidate node has an estimated acceptance probability q. Taking the
candidates in decreasing q, the step verifying the first k of them emits
B + sum(q) tokens (B roots, the expected accepted drafts) in ``cost[k]``
seconds; the best k maximises that rate. Per request the chosen prefix is its
top-n by q, which is ancestor-closed (a node's q never exceeds its parent's),
i.e. a valid tree.

Pure numpy; the adaptive budget (``budget``) supplies q and the costs.
"""

from __future__ import annotations

import numpy as np


def best_prefix(q: np.ndarray, m: int, cost: np.ndarray,
                extra: float) -> tuple[np.ndarray, float]:
    """Budgets [B] of the batch-wide best prefix of candidates by ``q`` [B, N]
    (each request's ``m`` best), and its rate; ``cost[k]``: a step verifying k
    nodes; ``extra``: added to every step that verifies any (e.g. branching)."""
    B = q.shape[0]
    top = -np.sort(-q, axis=1)[:, :m]                                  # [B, m]
    flat = -np.sort(-top.ravel())
    gain = B + np.concatenate([[0.0], np.cumsum(flat, dtype=np.float64)])
    rate = gain / (cost + extra * (np.arange(flat.size + 1) > 0))
    best_k = int(np.argmax(rate))
    if best_k == 0 or flat[best_k - 1] <= 0.0:
        return np.zeros(B, dtype=np.int64), float(rate[0])
    # Nodes at or above the threshold (ties may add a few; harmless).
    return (top >= flat[best_k - 1]).sum(1).astype(np.int64), float(rate[best_k])


def best_extension(q: np.ndarray, base_gain: float, base_nodes: int, cost: np.ndarray,
                   extra: float) -> tuple[float, float]:
    """The least estimate q a node of ``q`` (any shape; 0 = no node) needs to be
    verified beside a selection already made, which emits ``base_gain`` tokens
    from ``base_nodes`` verified nodes: the cut that maximises the step's rate
    (gain / ``cost[base_nodes + k]``, ``extra`` added once any is taken), and
    that rate. ``inf``: none pays. Copy branches join the drafter's selection
    this way."""
    flat = -np.sort(-q[q > 0.0].ravel())
    room = max(0, min(flat.size, cost.size - 1 - base_nodes))
    flat = flat[:room]
    gain = base_gain + np.concatenate([[0.0], np.cumsum(flat, dtype=np.float64)])
    spent = cost[base_nodes: base_nodes + room + 1] + extra * (np.arange(room + 1) > 0)
    rates = gain / spent
    best_k = int(np.argmax(rates))
    return (float("inf") if best_k == 0 else float(flat[best_k - 1])), float(rates[best_k])
