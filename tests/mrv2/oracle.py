"""A trie oracle for the tree engine on MRV2 (T > 0 tests), as
``tests/integration/oracle.py``'s ``trie`` mode is for V1: each request's tree holds
the most frequent continuations plain MRV2 sampled after its output so far, at most
``max_children`` a node, so trees are accepted deep and across siblings, where a
biased acceptance rule would show. MRV2 verifies exactly ``num_nodes`` drafts, so a
shorter trie tree is topped up with decoy leaves (random tokens: still proposals
that acceptance verifies). The tree drafter still runs first (its drafts replaced)."""

from __future__ import annotations

import random

import torch

from tests.integration.oracle import build_tries, trie_tree


def with_decoys(rng: random.Random, tokens: list[int], parents: list[int], n: int,
                vocab: int) -> tuple[list[int], list[int]]:
    """``tokens``/``parents`` (BFS, root 0) grown to ``n`` nodes with leaves under the
    last node's parent (the root if empty): same depth, after it, so BFS order holds."""
    tokens, parents = list(tokens), list(parents)
    parent = parents[-1] if parents else 0
    used = {t for t, p in zip(tokens, parents) if p == parent}
    while len(tokens) < n:
        token = rng.randrange(vocab)
        if token not in used:
            used.add(token)
            tokens.append(token)
            parents.append(parent)
    return tokens, parents


def install(worker, reference: dict, max_children: int | None = None, seed: int = 0) -> bool:
    """collective_rpc target: each request whose prompt is in ``reference`` (prompt
    ids joined by ',' -> sampled outputs) drafts its trie tree."""
    from vllm_treespec.tree.proposed import ProposedTree

    runner = worker.model_runner
    spec, steps, req_states = runner.speculator, runner.tree_steps, runner.req_states
    tries = build_tries(reference)
    rng = random.Random(seed)
    vocab = int(runner.vocab_size)
    original = spec._tree_drafts

    def tree_drafts(input_batch, num_rejected, num_nodes):
        drafts = original(input_batch, num_rejected, num_nodes)
        B = input_batch.num_reqs
        roots = (input_batch.seq_lens[:B].long() - num_rejected[:B].long()).tolist()
        for b in range(B):
            idx = int(input_batch.idx_mapping_np[b])
            prompt_len = int(req_states.prompt_len.np[idx])
            seq = req_states.all_token_ids.gpu[idx, :roots[b] + 1].tolist()
            trie = tries.get(",".join(map(str, seq[:prompt_len])))
            if trie is None:
                continue
            tokens, parents = trie_tree(trie, tuple(seq[prompt_len:]), num_nodes, max_children)
            tokens, parents = with_decoys(rng, tokens, parents, num_nodes, vocab)
            drafts[b] = -1
            drafts[b, :len(tokens)] = torch.tensor(tokens, dtype=drafts.dtype)
            steps.proposed[idx] = ProposedTree(tokens, parents, [0.0] * len(tokens))
            steps.counters["oracle_trees"] += 1
        return drafts

    spec._tree_drafts = tree_drafts
    return True
