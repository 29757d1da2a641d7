"""Tree acceptance where MRV2 calls its rejection sampler.

vLLM's ``RejectionSampler`` walks each request's rows in order and stops at the first
rejection: a tree's siblings are not a chain. Every tree request's output row is
``engine.accept``'s accepted path + bonus, with ``num_sampled = accepted + 1`` and
``num_rejected = drafts - accepted``: what ``post_update`` and the scheduler count
for a chain, which the speculator's commit then makes true of the KV. Greedy trees
take every node's argmax; sampled ones the engine's lossless multi-draft rule, seeded
ones with MRV2's own per-position Gumbel draws (``seeded.gumbel_draw``). vLLM's
rejection sampler runs for the whole batch, on a copy of the logits (the rows without
a tree, and the output's layout), unless nothing it computes would be kept
(``_stock_discarded``)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_treespec.engine.accept import SAMPLING_EPS, TreeSampling, accept_trees
from vllm_treespec.vllm_glue.mrv2.seeded import gumbel_draw
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps


class TreeRejectionSampler:
    def __init__(self, stock, sampler, steps: TreeSteps):
        self.stock, self.sampler, self.steps = stock, sampler, steps
        self.draw_seeded = gumbel_draw(getattr(sampler, "use_fp64_gumbel", False))

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None, *args):
        step = self.steps.step
        if step is None:
            return self.stock(logits, input_batch, draft_logits, *args)
        sampling, seeds = self.tree_sampling(input_batch, step)
        if self._stock_discarded(input_batch, step, sampling):
            out = self._empty_output(input_batch, logits.device)
        else:
            out = self.stock(logits.clone(), input_batch, draft_logits, *args)
        acc = accept_trees(logits, step, sampling, seeds, self.draw_seeded)
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

    def _stock_discarded(self, input_batch, step, sampling: TreeSampling) -> bool:
        """Whether vLLM's rejection sampler would compute nothing kept: every request
        verifies a tree, none asks for logprobs, and some samples at T > 0, where
        its probabilistic verification of every row (a vocabulary's worth of work
        per row, one interpreter program per row and block on the CPU lane) costs
        the most. An all-greedy batch of trees still runs it (its kernels take no
        noise and no draft logits there), as ``tests/unit/test_mrv2_tree.py`` pins."""
        states = self.sampler.sampling_states
        idx = input_batch.idx_mapping_np[:input_batch.num_reqs]
        return (int(step.req_index.numel()) == input_batch.num_reqs
                and not sampling.all_greedy
                and int(np.max(states.num_logprobs[idx], initial=-1)) < 0
                and not getattr(self.sampler, "compute_nans", False))

    def _empty_output(self, input_batch, device):
        """MRV2's ``SamplerOutput`` for a batch of trees, every row filled in by the
        caller: the rejection sampler's dtypes and ``[num_reqs, k + 1]`` width."""
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        n = input_batch.num_reqs
        width = int(getattr(self.stock, "num_speculative_steps", 0)) + 1
        return SamplerOutput(
            sampled_token_ids=torch.full((n, width), -1, dtype=torch.int64, device=device),
            logprobs_tensors=None, num_nans=None,
            num_sampled=torch.zeros(n, dtype=torch.int32, device=device),
            num_rejected=torch.zeros(n, dtype=torch.int32, device=device))

    def tree_sampling(self, input_batch, step) -> tuple[TreeSampling, dict[int, int]]:
        """What tree acceptance reads of MRV2's sampling state, per batch row, and
        the seeds of sampled rows whose request set one (MRV2 draws every request
        with a seed, a random one where none was set; those sample unseeded here,
        from the same distribution). Parameters acceptance does not reproduce are
        refused at the frontend (``requests``); should one get here, the step
        fails by name rather than sampling differently from plain decoding."""
        idx = input_batch.idx_mapping_np
        tree_idx = idx[step.req_index.cpu().numpy()]
        states = self.sampler.sampling_states
        penalties = getattr(self.sampler, "penalties_state", None)
        _refuse_unsupported(states, penalties, tree_idx)
        temp_np = states.temperature.np[idx]
        temperature = torch.from_numpy(temp_np.copy())
        greedy = bool((temperature < SAMPLING_EPS).all())
        top_k = states.top_k.np[idx]
        top_p = states.top_p.np[idx]
        vocab = states.vocab_size
        sampling = TreeSampling(
            all_greedy=greedy, temperature=None if greedy else temperature,
            top_k=(None if np.all(top_k >= vocab) else torch.from_numpy(top_k.astype(np.int64))),
            top_p=None if np.all(top_p >= 1.0) else torch.from_numpy(top_p.copy()))
        seeded = np.nonzero(states.seeds_set[idx] & (temp_np >= SAMPLING_EPS))[0]
        seeds = {int(b): int(states.seeds.np[idx[b]]) for b in seeded}
        return sampling, seeds


def _refuse_unsupported(states, penalties, tree_idx: np.ndarray) -> None:
    """The frontend's refusals (``requests.mrv2_refusal``), checked again on the
    parameters MRV2's sampling state shows: a request that bypassed the frontend."""
    why = []
    if penalties is not None and np.any(penalties.use_penalty[tree_idx]):
        why.append("penalties")
    # Greedy ignores min-p (it never removes the argmax).
    if np.any((states.min_p.np[tree_idx] != 0.0)
              & (states.temperature.np[tree_idx] >= SAMPLING_EPS)):
        why.append("min_p")
    if np.any(states.num_logprobs[tree_idx] >= 0):
        why.append("logprobs")
    if why:
        raise NotImplementedError(f"eagle3_tree on MRV2 does not verify trees of requests "
                                  f"with {', '.join(why)} (docs/mrv2.md)")
