"""Tree acceptance where MRV2 calls its rejection sampler.

vLLM's ``RejectionSampler`` walks each request's rows in order and stops at the first
rejection: a tree's siblings are not a chain. Here vLLM's sampler still runs for the
whole batch (the rows without a tree, and the output's layout), on a copy of the
logits, then every tree request's output row is replaced by ``engine.accept``'s
accepted path + bonus, with ``num_sampled = accepted + 1`` and ``num_rejected =
drafts - accepted``: what ``post_update`` and the scheduler count for a chain, which
the speculator's commit then makes true of the KV."""

from __future__ import annotations

import numpy as np
import torch

from vllm_treespec.engine.accept import SAMPLING_EPS, TreeSampling, accept_trees
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps


class TreeRejectionSampler:
    def __init__(self, stock, sampler, steps: TreeSteps):
        self.stock, self.sampler, self.steps = stock, sampler, steps

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None, *args):
        step = self.steps.step
        if step is None:
            return self.stock(logits, input_batch, draft_logits, *args)
        out = self.stock(logits.clone(), input_batch, draft_logits, *args)
        acc = accept_trees(logits, step, self.tree_sampling(input_batch, step), {},
                           _no_seeded_draws)
        self.steps.accepted(acc)
        rows = step.req_index
        tokens = out.sampled_token_ids
        tokens[rows] = -1  # MRV2's padding past num_sampled
        # Past a tree's accepted path + bonus its row is padding: the narrower wins.
        width = min(acc.tokens.shape[1], tokens.shape[1])
        tokens[rows, :width] = acc.tokens[:, :width].to(tokens.dtype)
        n_draft = step.tree.node_counts.to(out.num_rejected.dtype)
        out.num_sampled[rows] = (acc.num_accepted + 1).to(out.num_sampled.dtype)
        out.num_rejected[rows] = n_draft - acc.num_accepted.to(n_draft.dtype)
        return out

    def tree_sampling(self, input_batch, step) -> TreeSampling:
        """What tree acceptance reads of MRV2's sampling state, per batch row. A tree
        request whose parameters acceptance does not reproduce here is refused by name
        rather than sampled differently from plain decoding."""
        idx = input_batch.idx_mapping_np
        tree_idx = idx[step.req_index.cpu().numpy()]
        states = self.sampler.sampling_states
        penalties = getattr(self.sampler, "penalties_state", None)
        _refuse_unsupported(states, penalties, tree_idx)
        temperature = torch.from_numpy(states.temperature.np[idx].copy())
        greedy = bool((temperature < SAMPLING_EPS).all())
        top_k = states.top_k.np[idx]
        top_p = states.top_p.np[idx]
        vocab = states.vocab_size
        return TreeSampling(
            all_greedy=greedy, temperature=None if greedy else temperature,
            top_k=(None if np.all(top_k >= vocab) else torch.from_numpy(top_k.astype(np.int64))),
            top_p=None if np.all(top_p >= 1.0) else torch.from_numpy(top_p.copy()))


def _refuse_unsupported(states, penalties, tree_idx: np.ndarray) -> None:
    why = []
    if penalties is not None and np.any(penalties.use_penalty[tree_idx]):
        why.append("penalties")
    if np.any(states.min_p.np[tree_idx] != 0.0):
        why.append("min_p")
    if np.any(states.seeds_set[tree_idx] & (states.temperature.np[tree_idx] != 0.0)):
        why.append("a seed at temperature > 0")
    if np.any(states.num_logprobs[tree_idx] >= 0):
        why.append("logprobs")
    if why:
        raise NotImplementedError(f"eagle3_tree on MRV2 does not verify trees of requests "
                                  f"with {', '.join(why)} yet (docs/mrv2.md)")


def _no_seeded_draws(*_args):
    raise AssertionError("seeded rows are refused before acceptance (_refuse_unsupported)")
