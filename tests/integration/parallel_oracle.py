"""An oracle for parallel drafting (``"draft": "parallel"``): K marginals.

A head trained for parallel drafting gives, in one forward, one distribution per
depth whatever the tokens before it; ``TreeBuilder.grow_from_marginals`` grows
the tree from them. The real head is weak beyond depth 1, so at T > 0 its trees
would rarely be accepted past the root's children. This oracle keeps the whole
path (the first pass and the slots' forward still run) and replaces the
distributions the builder reads: each depth's marginal is that of a plain-vLLM
sample of the same prompt, restricted to the samples that continue what the
request has emitted so far. The trees are then built by the product's own code,
shaped like a parallel head's (every node's children drawn from the same
per-depth ranking), and accepted at several depths.
"""

from __future__ import annotations

import types
from collections import Counter

SMOOTHING = 0.02  # mass spread over the whole draft vocabulary (no -inf scores)


def marginal_logprobs(samples: list[list[int]], context: tuple, depths: int,
                      draft_id: dict[int, int], draft_vocab: int):
    """[depths, draft_vocab] log-probs: depth d's next-token frequencies among
    the samples that start with ``context``, in the drafter's vocabulary."""
    import torch

    n = len(context)
    follow = [s for s in samples if tuple(s[:n]) == context]
    out = torch.full((depths, draft_vocab), SMOOTHING / draft_vocab)
    for d in range(depths):
        counts = Counter(s[n + d] for s in follow if len(s) > n + d)
        total = sum(counts.values())
        for token, c in counts.items():
            if token in draft_id:
                out[d, draft_id[token]] += (1.0 - SMOOTHING) * c / total
    return out.log()


def install(worker, reference: dict, seed: int = 0, vocab: int = 49152,
            mode: str = "marginals") -> bool:
    """collective_rpc target: reference = {prompt ids joined by ',': list of
    sampled outputs}. The drafter must run ``"draft": "parallel"``. (``seed``,
    ``vocab`` and ``mode``: oracle.install's signature; nothing here is random.)"""
    import torch

    from tests.integration.oracle import output_so_far

    runner = worker.model_runner
    drafter = runner.drafter
    assert drafter.tree_cfg.draft == "parallel", drafter.tree_cfg
    token_map = drafter._token_map()
    draft_id = {int(t): i for i, t in enumerate(token_map.tolist())}
    original_propose = drafter.propose
    real_logprobs = drafter.draft_vocab_logprobs
    levels = drafter.levels  # parallel_drafts.ParallelLevels
    real_marginals = levels.marginals

    def propose(self, *args, **kwargs):
        B = kwargs["common_attn_metadata"].batch_size()
        rows = []
        for b, req_id in enumerate(runner.input_batch.req_ids[:B]):
            state = runner.requests[req_id]
            samples = reference.get(",".join(map(str, state.prompt_token_ids)))
            if samples is None:
                rows = None  # not a request of the test's: the head drafts
                break
            context = output_so_far(runner, b, state)
            rows.append(marginal_logprobs(samples, context, self.tree_cfg.depth,
                                          draft_id, token_map.shape[0]))
        # Set every step (a step that drafts nothing leaves none behind): the root's
        # children read depth 1 (the first draft_vocab_logprobs call), the slots the rest.
        m = torch.stack(rows) if rows else None
        self._oracle_root, self._oracle_slots = (None, None) if m is None else (m[:, 0], m[:, 1:])
        return original_propose(*args, **kwargs)

    def draft_vocab_logprobs(self, hidden):
        out = real_logprobs(hidden)
        root, self._oracle_root = self._oracle_root, None
        return out if root is None else root.to(out)

    def parallel_marginals(step, slots):
        out = real_marginals(step, slots)  # the forward still runs
        m = drafter._oracle_slots
        return out if m is None else m[:, :slots].to(out)

    drafter._oracle_root = drafter._oracle_slots = None
    drafter.propose = types.MethodType(propose, drafter)
    drafter.draft_vocab_logprobs = types.MethodType(draft_vocab_logprobs, drafter)
    levels.marginals = parallel_marginals
    return True
