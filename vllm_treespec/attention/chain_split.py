"""Tree verify as a batch of chains, for a paged kernel that knows causal attention only.

A tree's node sees the committed prefix plus its ancestors. Split the tree into
chains: every node continues its parent's chain if it is the parent's first
child, else it starts a new one. A chain whose last node is ``n`` at depth ``d``
becomes one causal "request" of the kernel: its keys are the prefix plus the
path root .. n at logical positions ``P .. P + d``, its queries are its own nodes
(the last positions of that path). Each node is computed exactly once, by the
same kernel and arithmetic as a chain step.

The real cache holds node ``i`` at position ``P + i`` (vLLM lays draft tokens
out linearly), which is a chain's path only where the path's node at depth j is
node j (the leading chain). Any other chain gets private copies of the logical
blocks its path occupies: the block holding the prefix's tail is copied whole
from the request's own block (into consecutive scratch blocks, one contiguous
copy per run: cheaper than copying the tail's strided positions), then the
path's K/V are written at their logical offsets. The scratch blocks are a few
that the runner reserves past the scheduler's; the prefix's full blocks are
shared through the block table, never copied. A step that needs more scratch
blocks than there are gets no plan (the caller verifies it another way).

Pure torch, host-side lists (trees are small); no vLLM import.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class ChainSplitPlan:
    """One verify step's tree rows as causal chain requests (shared by all layers).

    order:        [Nt] packed tree-row index of each chain-request query row
    query_start_loc / seq_lens / block_table: the chain requests, kernel-ready
    copies:       (src, dst, count): physical block src (a prefix's tail) copied to
                  scratch blocks dst .. dst + count - 1
    write_rows:   [W] packed tree rows whose K/V go to ``write_slots`` [W]
    read_slots:   [W] where those rows' K/V already are: their linear slots in
                  the request's own blocks (a backend that wrote the step's K/V
                  there first copies cache to cache instead of re-writing them)
    """

    order: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int
    copies: list[tuple[int, int, int]]
    write_rows: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    scratch: dict = dataclasses.field(default_factory=dict)  # kernel metadata, per step

    @property
    def num_chains(self) -> int:
        return self.seq_lens.shape[0]


def _chains(mask: list[list[bool]], n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(chains, path of each node) of a BFS-ordered tree given its ancestor-or-self mask."""
    paths = [[j for j in range(i + 1) if mask[i][j]] for i in range(n)]
    first_child: dict[int, int] = {}
    chains: list[list[int]] = []
    chain_of: dict[int, int] = {}
    for i in range(n):
        parent = paths[i][-2] if i else None
        if parent is not None and first_child.setdefault(parent, i) == i:
            chain_of[i] = chain_of[parent]
            chains[chain_of[i]].append(i)
        else:
            chain_of[i] = len(chains)
            chains.append([i])
    return chains, paths


def split_into_chains(tree_mask: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                      scratch_blocks: list[int]) -> ChainSplitPlan | None:
    """Plan the chain requests of packed tree rows (``PagedTreeAttentionMetadata``
    terms: request b's T_b rows start at ``query_start_loc[b]``, its KV length
    ``seq_lens[b]`` counts them). None if ``scratch_blocks`` are too few."""
    qsl = query_start_loc.tolist()
    seq = seq_lens.tolist()
    masks = tree_mask.bool().tolist()
    tables = block_table.tolist()
    bs = block_size
    free = sorted(scratch_blocks, reverse=True)  # popped in increasing order
    order, q_lens, lens, rows_bt = [], [], [], []
    copies: list[list[int]] = []
    write_rows, write_slots, read_slots = [], [], []
    for b in range(len(seq)):
        n = qsl[b + 1] - qsl[b]
        if n == 0:
            continue
        P = seq[b] - n
        chains, paths = _chains(masks[b], n)
        for chain in chains:
            path = paths[chain[-1]]
            d = len(path) - 1
            table = list(tables[b][: (P + d) // bs + 1])
            if any(node != j for j, node in enumerate(path)):
                first, last = P // bs, (P + d) // bs
                if last - first + 1 > len(free):
                    return None
                for logical in range(first, last + 1):
                    blk = free.pop()
                    if logical == first and P % bs:
                        src = table[logical]
                        if copies and copies[-1][0] == src and sum(copies[-1][1:]) == blk:
                            copies[-1][2] += 1
                        else:
                            copies.append([src, blk, 1])
                    table[logical] = blk
                for j, node in enumerate(path):
                    write_rows.append(qsl[b] + node)
                    write_slots.append(table[(P + j) // bs] * bs + (P + j) % bs)
                    read_slots.append(tables[b][(P + node) // bs] * bs + (P + node) % bs)
            order += [qsl[b] + node for node in chain]
            q_lens.append(len(chain))
            lens.append(P + d + 1)
            rows_bt.append(table)
    width = max(len(t) for t in rows_bt)
    bt = torch.zeros(len(rows_bt), width, dtype=block_table.dtype)
    for i, t in enumerate(rows_bt):
        bt[i, : len(t)] = torch.tensor(t, dtype=block_table.dtype)
    qsl_out = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl_out[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    dev = block_table.device
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    return ChainSplitPlan(
        order=as_long(order), query_start_loc=qsl_out.to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_table=bt.to(dev),
        max_seq_len=max(lens),
        copies=[tuple(c) for c in copies],
        write_rows=as_long(write_rows), write_slots=as_long(write_slots),
        read_slots=as_long(read_slots))


def scratch_prefix(parents: list[int], block_size: int, capacity: int,
                   root_position: int | None = None) -> tuple[int, int]:
    """(n, blocks): the longest BFS prefix of a draft tree (its first ``n`` nodes;
    ``parents`` as in ``ProposedTree``, root = 0) whose chains fit ``capacity``
    scratch blocks in ``split_into_chains``, and the blocks it takes.

    A chain whose path is not the linear one (node j at depth j) takes the blocks
    from the root's to its last node's: exactly that count with the verify step's
    ``root_position`` (its P), else ``1 + ceil(d / B)`` for a last node at depth d,
    a bound wherever the root sits in its block. A prefix's chains are the tree's
    chains cut short (a node's first child comes first in BFS order), so the cost
    only grows with ``n``."""
    def blocks(depth: int) -> int:
        if root_position is None:
            return 1 + -(-depth // block_size)
        return (root_position + depth) // block_size - root_position // block_size + 1

    path_len = [1]                           # nodes on the path root .. node, per node
    first_child: dict[int, int] = {}
    chain_of = [0]
    chain_cost: dict[int, int] = {}
    total = 0
    for k, p in enumerate(parents, start=1):
        depth = path_len[p]
        chain = chain_of[p] if first_child.setdefault(p, k) == k else k
        cost = 0 if k == depth else blocks(depth)  # linear iff node k sits at depth k
        grown = total - chain_cost.get(chain, 0) + cost
        if grown > capacity:
            return k - 1, total
        total, chain_cost[chain] = grown, cost
        path_len.append(depth + 1)
        chain_of.append(chain)
    return len(parents), total
