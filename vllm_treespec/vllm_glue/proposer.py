"""The EAGLE-3 drafter growing a tree instead of a chain.

Step 1 is vLLM's own first drafting pass, unchanged: after the verify step the
runner has compacted the accepted path to the front of each request's tokens, so
the drafter sees an ordinary chain (accepted tokens + bonus) and runs exactly as
stock ``eagle3`` would, writing its KV into the paged cache. Below the roots'
children a level strategy (``draft_levels``: levels one after another in a side
buffer or as paged chain steps, or one parallel-drafting forward) grows the
frontier; the best ``num_nodes`` candidates form the tree, whose tokens go to
the scheduler as the request's draft tokens (BFS order), and whose shape is kept
here until the runner verifies it.

When the budget says "no drafts" for a step, the first pass is skipped too
(prefill chunks included) and its inputs deferred (``deferred_drafts``); the
next drafting step catches the drafter's KV up in one batched pass before its
own first pass (``paged_drafts``). A request that gets no tree
(``tree_safe``) is neither planned for nor grown nor caught up, and a batch of
only such requests is an off step without a plan (``_tree_rows``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_treespec.config import TreeSpecConfig
from vllm_treespec.observability import trace_dir_from
from vllm_treespec.tree_fallback import validated
from vllm_treespec.tree import DynamicTreeBuilder, StaticTopology, StaticTreeBuilder, TreeBatch
from vllm_treespec.tree.proposed import ProposedTree, ProposedTrees
from vllm_treespec.vllm_glue import rank_agreement, support
from vllm_treespec.tree.shared_suffixes import SharedSuffixes
from vllm_treespec.vllm_glue.copy_source import MAX_NGRAM, MIN_NGRAM, CopySource
from vllm_treespec.vllm_glue.deferred_drafts import DeferredDrafts, raw_first_pass_inputs
from vllm_treespec.vllm_glue.draft_faults import DraftFaults, device_failure
from vllm_treespec.vllm_glue.draft_grammars import DraftGrammars
from vllm_treespec.vllm_glue.hand_over import DraftHandOver
from vllm_treespec.engine.levels import LevelsRun, LevelStep, StepTimes, hand_to_budget
from vllm_treespec.vllm_glue.draft_levels import SequentialLevels
from vllm_treespec.vllm_glue.paged_drafts import PagedForwards
from vllm_treespec.vllm_glue.parallel_drafts import ParallelLevels
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm


class TreeEagleProposer(EagleProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        # The runner's (parsed once: spec_config.tree_config_from_vllm).
        cfg = runner.tree_cfg if runner is not None else tree_config_from_vllm(vllm_config)
        assert cfg is not None
        self.tree_cfg: TreeSpecConfig = cfg
        self.topology = StaticTopology.from_choices(cfg.choices) if cfg.is_static else None
        self.proposed = ProposedTrees()
        self.last_draft_seconds = 0.0
        # Set by the runner when the adaptive budget is on (vllm_treespec.policy).
        self.adaptive_budget = None
        self.last_depth = cfg.depth
        # Drafter passes skipped while speculation is off (see deferred_drafts),
        # caught up in passes of at most max_num_tokens (the drafter's buffers).
        self.deferred = DeferredDrafts(self.max_num_tokens, self.hidden_size,
                                       lambda h: self.model.combine_hidden_states(h))
        self.defer_when_off = True  # False: run the first pass every step (reference)
        # One-wide levels as stock chain steps on the paged cache (the runner's
        # device says whether its attention backend serves them natively).
        self.paged = PagedForwards(self)
        self.levels = SequentialLevels(
            self, self.paged if getattr(runner, "paged_chain_levels", False) else None)
        self.catch_up_tokens = 0
        self.dropped_tokens = 0  # deferred inputs dropped while off (bounded memory)
        self.faults = DraftFaults()  # drafting steps that raised (see propose)
        self.copies = (CopySource(cfg.copy_branches, cfg.copy_length,
                                  SharedSuffixes(cfg.cross_request_tokens, MAX_NGRAM, MIN_NGRAM,
                                                 cfg.copy_length)
                                  if cfg.cross_request_tokens else None,
                                  cfg.cross_request_prompts)
                       if cfg.copy_branches else None)
        self.hand_over = DraftHandOver(self)
        # Structured requests drafted under their grammar, where the scheduler
        # walks grammars down trees (``draft_grammars``).
        self.grammars = (DraftGrammars(vllm_config)
                         if getattr(runner, "grammar_trees", False) else None)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        token_map = self._token_map()
        if token_map is not None:  # a hub drafter's too, whose files were not checked
            support.check_token_map(token_map, self.vllm_config.model_config.get_vocab_size(),
                                    self.vllm_config.speculative_config.model)
        if self.tree_cfg.draft == "parallel":
            self.levels = ParallelLevels(self)  # reads the loaded head's slot state
        if self.grammars is not None:
            self.grammars.load()

    # ------------------------------------------------------------------ drafts
    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the drafter's own (reduced) vocabulary."""
        logits = self.model.logits_processor(self.model.lm_head, hidden)
        return torch.log_softmax(logits.float(), dim=-1)

    def _token_map(self) -> torch.Tensor | None:
        d2t = getattr(self.model, "draft_id_to_target_id", None)
        if d2t is None:
            return None
        cached = getattr(self, "_token_map_cache", None)
        if cached is None or cached.shape[0] != d2t.shape[0]:
            cached = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
            self._token_map_cache = cached
        return cached

    def _builder(self, batch_size: int, depth: int):
        cfg = self.tree_cfg
        if self.topology is not None:
            return StaticTreeBuilder(batch_size, self.topology, self.device, None,
                                     self._token_map())
        return DynamicTreeBuilder(batch_size, cfg.top_k, depth,
                                  min(cfg.num_nodes, cfg.max_candidates(depth)),
                                  self.device, None, self._token_map(), cfg.depth_weight)

    def propose(self, *args, **kwargs) -> list[list[int]]:
        """Draft trees for this step's requests (vLLM's ``propose`` arguments).

        Drafts are only proposals: if drafting raises, this step goes without
        drafts (plain decoding is always correct) rather than taking the engine
        down; the fault is counted and logged (``DraftFaults``: out-of-memory and
        device errors, and one error step after step, are raised instead).
        """
        t0 = time.perf_counter()
        try:
            drafts = self._draft_trees(t0, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- see above
            if device_failure(err):
                raise
            rank_agreement.any_rank(True)
            return self._no_drafts_after(err, t0)
        if rank_agreement.any_rank(False):  # failed on another rank: none here either
            return self._no_drafts_after(RuntimeError("drafting failed on another "
                                                      "tensor-parallel rank"), t0)
        self.faults.succeeded()
        return drafts

    def _no_drafts_after(self, err: Exception, t0: float) -> list[list[int]]:
        self.faults.failed(err)
        # Deferred inputs may be half caught up: drop them (drafter KV those
        # positions miss costs draft quality only).
        self.deferred.forget(list(self.runner.input_batch.req_ids))
        metrics = getattr(self.runner, "tree_metrics", None)
        if metrics is not None:
            metrics.on_draft_fault()
        return self._finish_step(self.hand_over(None), t0)

    def _draft_trees(self, t0, num_speculative_tokens, target_token_ids, target_positions,
                     target_hidden_states, next_token_ids, token_indices_to_sample,
                     common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                     num_rejected_tokens_gpu=None, slot_mappings=None):
        batch_size = common_attn_metadata.batch_size()
        req_ids = list(self.runner.input_batch.req_ids[:batch_size])
        rows = self._tree_rows(batch_size)
        depth = self._plan_depth([req_ids[b] for b in rows])
        roots = next_token_ids[:batch_size]
        if depth == 0 and self.defer_when_off and self._verified_no_drafts(
                common_attn_metadata, token_indices_to_sample):
            # Off, and every row this step is a token the target just took: a
            # plain step would not run the drafter, so neither do we. The
            # first-pass inputs wait in self.deferred with the target's raw
            # states, combined (fc) only at catch-up: requests that finish or
            # are trimmed while off never pay it.
            ids, first, last = raw_first_pass_inputs(target_token_ids, roots,
                                                     common_attn_metadata, batch_size)
            n = common_attn_metadata.num_actual_tokens
            self._defer(req_ids, ids, target_positions[:n], target_hidden_states[:n], first,
                        last, range(batch_size))
            return self._finish_off_step(req_ids, t0, roots)

        # --- first pass: stock EAGLE over the (compacted) accepted chain -----
        num_tokens, token_indices_to_sample, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=self.model.combine_hidden_states(target_hidden_states),
            token_indices_to_sample=token_indices_to_sample, cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        first_rows = cad.query_start_loc_cpu[:batch_size].tolist()
        last = token_indices_to_sample.tolist()
        inputs = (self.input_ids[:num_tokens], self._get_positions(num_tokens),
                  self.hidden_states[:num_tokens], first_rows, last)
        if depth == 0 and self.defer_when_off:
            # Off after a step that verified drafts (or outside the stock EAGLE
            # layout): a plain step would not run the drafter, so neither do we
            # (its inputs, past the rejected drafts, wait in self.deferred).
            self._defer(req_ids, *inputs, range(batch_size))
            return self._finish_off_step(req_ids, t0, roots)
        part = None  # the first pass's batch rows, where not all
        if depth and len(rows) < batch_size:  # so do those of requests without a tree
            tree_rows = set(rows)
            self._defer(req_ids, *inputs, [b for b in range(batch_size) if b not in tree_rows])
            part = (rows, first_rows, last)
        times = StepTimes(t0)
        caught_up = self._catch_up(cad, req_ids, first_rows, num_tokens, times, rows)
        last_hidden, hidden = self._first_pass(cad, num_tokens, times, token_indices_to_sample,
                                               part)
        if depth == 0:  # off, not deferring (the reference): nothing to draft
            return self._finish_step(self.hand_over(None, roots), t0)

        # --- the levels below the tree rows' roots' children (draft_levels) ---
        step = self._level_step(cad, batch_size, depth, num_rejected_tokens_gpu, rows)
        builder = self._builder(step.batch_size, depth)
        root_logprobs = self.draft_vocab_logprobs(last_hidden)  # the tree rows'
        if step.dynamic and self.grammars is not None:  # structured rows: under their grammars
            root_logprobs = self.grammars.masked_step(step, root_logprobs, self.runner, rows,
                                                      roots, self._token_map())
        level = builder.first_level(root_logprobs)
        run = self.levels.grow(builder, level, hidden.unsqueeze(1), step)
        if step.draft_masks is not None:
            self.runner.tree_metrics.on_grammar_drafts(step.draft_masks.masked_nodes)
        return self._selected_drafts(builder, step, run, roots.long(), times,
                                     first_tokens=num_tokens, caught_up=caught_up, rows=rows)

    def _tree_rows(self, batch_size: int) -> list[int]:
        """The batch rows whose requests may get a tree this step (``tree_safe``).
        The others (bad words, specific-token logprobs, ...) decode as plain
        rows: no first pass, levels or catch-up, and without tree rows no plan
        (an off step), so that they cost what plain decoding costs."""
        allowed = self.runner.tree_allowed_mask(batch_size)
        return [b for b, ok in enumerate(allowed) if ok]

    def _defer(self, req_ids: list[str], ids, positions, hidden, first: list[int],
               last: list[int], rows) -> None:
        """``deferred.defer`` for the batch ``rows`` whose requests may get a tree
        now or later (``tree_allowed_mask(later=True)``: pending min_tokens, caught
        up at their first tree); the others never will, so nothing of theirs is kept."""
        later = self.runner.tree_allowed_mask(len(req_ids), later=True)
        self.deferred.forget([r for r, ok in zip(req_ids, later) if not ok])
        keep = [b for b in rows if later[b]]
        self.deferred.defer([req_ids[b] for b in keep], ids, positions, hidden,
                            [first[b] for b in keep], [last[b] for b in keep])

    def _verified_no_drafts(self, cad, token_indices_to_sample) -> bool:
        """Whether each request's rows this step are all tokens the target took
        (no drafts verified, so no rejected rows), in the stock EAGLE layout."""
        stock_layout = not (getattr(self, "use_heterogeneous_vocab", False)
                            or getattr(self, "needs_extra_input_slots", False))
        return stock_layout and (cad.max_query_len == 1 or token_indices_to_sample is None)

    def _plan_depth(self, req_ids: list[str]) -> int:
        """This step's drafting depth (0: no drafts) for the requests that may
        get a tree: the adaptive budget's plan, else the configured depth; 0
        without any (no plan: that step is plain, not one the budget kept off)."""
        self._batch_req_ids = req_ids
        if not req_ids:
            self.last_depth = 0
            return 0
        budget = self.adaptive_budget
        if budget is not None and budget.catch_up_pending is None:
            budget.catch_up_pending = self._catch_up_pending
        depth = budget.plan_depth(len(req_ids)) if budget is not None else self.tree_cfg.depth
        self.last_depth = depth
        return depth

    def _catch_up(self, cad, req_ids: list[str], first_rows: list[int], num_tokens: int,
                  times: StepTimes, rows: list[int]) -> int:
        """Forward the drafter inputs that off steps deferred (``deferred_drafts``),
        before this step's first pass; returns the tokens caught up. Only the
        batch ``rows`` that get a tree: the others' inputs wait for theirs."""
        t = time.perf_counter()
        tokens = 0
        if len(self.deferred):
            # Passes of at most the drafter's token budget, each counted as it ends.
            start = self._get_positions(num_tokens)[first_rows].tolist()
            for batch in self.deferred.take([req_ids[b] for b in rows],
                                            [start[b] for b in rows], self.max_num_tokens):
                batch.rows = [rows[i] for i in batch.rows]  # from take's list to the batch
                done = self.paged.catch_up_pass(cad, batch)
                tokens += done
                self.catch_up_tokens += done
        times.catch_up = time.perf_counter() - t
        return tokens

    def _first_pass(self, cad, num_tokens: int, times: StepTimes, sample, part=None):
        """The drafter's (last_hidden, hidden) at each request's ``sample`` row:
        vLLM's first pass, or with ``part`` (rows, first rows, last rows) that
        of those batch rows alone (``PagedForwards.first_pass_rows``)."""
        t = time.perf_counter()
        if part is not None:
            out = self.paged.first_pass_rows(cad, *part, num_tokens)
            times.first = time.perf_counter() - t
            return out
        _, per_layer_md = self.build_per_group_and_layer_attn_metadata(cad)
        model_kwargs, _ = self.build_model_inputs_first_pass(num_tokens, num_tokens, None)
        with set_forward_context(per_layer_md, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(num_tokens,
                                                                     cad.slot_mapping)):
            last_hidden, hidden = self.model(**model_kwargs)
        times.first = time.perf_counter() - t
        return last_hidden[sample], hidden[sample]

    def _level_step(self, cad, batch_size: int, depth: int, num_rejected_tokens_gpu,
                    rows: list[int]) -> LevelStep:
        """The levels' shared inputs, for the batch's ``rows``."""
        # Drafter KV is valid for positions < P' (the new root's position).
        prefix_len = cad.seq_lens[:batch_size].long()
        if num_rejected_tokens_gpu is not None:
            prefix_len = prefix_len - num_rejected_tokens_gpu[:batch_size].long()
        prefix_len = prefix_len[rows]
        budget = self.adaptive_budget
        dynamic = self.topology is None
        return LevelStep(
            batch_size=len(rows), depth=depth, prefix_len=prefix_len,
            max_prefix=int(prefix_len.max()) if rows else 0,
            block_table=cad.block_table_tensor[rows],
            width=budget.level_width(depth) if budget is not None else self.tree_cfg.top_k,
            dynamic=dynamic, side_capacity=self._side_capacity(),
            # The adaptive budget may end a step's drafting before its planned depth.
            budget=budget if dynamic else None)

    def _selected_drafts(self, builder, step: LevelStep, run: LevelsRun, roots: torch.Tensor,
                         times: StepTimes, first_tokens: int, caught_up: int,
                         rows: list[int]) -> list[list[int]]:
        """The trees the budget selects from the builder's candidates (those of
        the batch's ``rows``), checked and handed over; the budget learns what
        the step cost and kept."""
        budget, node_budget, chain_only = self.adaptive_budget, None, False
        if budget is not None and step.dynamic:
            node_budget, chain_only = budget.select(
                builder.candidate_scores(), builder.M, builder.chain_candidates())
        trees = (builder.finish(roots[rows], node_budget, chain_only=True) if chain_only
                 else builder.finish(roots[rows], node_budget))
        selected = trees.node_counts.cpu().numpy()
        t = time.perf_counter()
        if self.tree_cfg.validate_invariants:
            trees = self.checked_trees(trees, step.prefix_len, rows)
        times.check = time.perf_counter() - t
        positions = [0] * len(roots)  # the roots' (hand_over reads the tree rows' only)
        for b, p in zip(rows, step.prefix_len.tolist()):
            positions[b] = p
        drafts = self.hand_over(trees, roots, positions, rows)
        if budget is not None:
            # What the step goes on to verify of the drafter's nodes: the
            # selection's, less what the scratch cut took (DraftHandOver.scratch_capacity).
            verified = np.minimum(selected, [len(drafts[b]) for b in rows])
            hand_to_budget(budget, step, run, times, first_tokens=first_tokens,
                           caught_up=caught_up, verified=float(verified.mean()),
                           branching=not chain_only, unverified=int((selected == 0).sum()),
                           agree=rank_agreement.timings)
        return self._finish_step(drafts, times.start)

    def _catch_up_pending(self) -> tuple[int, int]:
        """(Deferred drafter inputs of the batch at hand, their bound): what the
        next drafting step would catch up (the budget prices probes with it)."""
        return self.deferred.pending(self._batch_req_ids), self.deferred.max_tokens

    def _finish_off_step(self, req_ids: list[str], t0: float,
                         roots: torch.Tensor) -> list[list[int]]:
        if self.deferred.pending(req_ids) > self.deferred.max_tokens:
            # Bounded memory without a drafter pass: keep each request's most
            # recent inputs, about half the bound in all (quality only; see
            # deferred_drafts for the gaps this leaves).
            keep = max(1, self.deferred.max_tokens // (2 * len(req_ids)))
            self.dropped_tokens += self.deferred.trim(req_ids, keep)
        return self._finish_step(self.hand_over(None, roots), t0)

    def _finish_step(self, drafts: list[list[int]], t0: float) -> list[list[int]]:
        self.last_draft_seconds = time.perf_counter() - t0
        metrics = getattr(self.runner, "tree_metrics", None)
        if metrics is not None:
            metrics.on_draft(self.last_draft_seconds)
        return drafts

    def checked_trees(self, trees: TreeBatch, prefix_len: torch.Tensor,
                      rows: list[int] | None = None) -> TreeBatch:
        """Validate every tree (of the batch's ``rows``, None: all); a request
        whose tree is malformed gets no drafts this step (plain decoding is
        always correct) and the batch is dumped."""
        keep = trees.node_counts.clone()

        def without_drafts(b):
            keep[b] = 0

        req_ids = [self.runner.input_batch.req_ids[b]
                   for b in (range(trees.batch_size) if rows is None else rows)]
        return validated(lambda: trees.truncated(keep), self.runner.input_batch.vocab_size,
                         without_drafts, "draft", req_ids, prefix_len.tolist(),
                         trace_dir_from(self.tree_cfg.trace_dir))

    def _side_capacity(self) -> int:
        """Side-buffer columns one drafting step can use (all forwarded levels)."""
        cfg = self.tree_cfg
        if self.topology is not None:
            return max(1, sum(1 for i in range(1, self.topology.num_nodes + 1)
                              if i in set(self.topology.parent[1:])) + 1)
        return max(1, cfg.top_k * (cfg.depth - 1))

    # ------------------------------------------------------------------ verify
    def tree_for(self, req_id: str, scheduled: list[int], shape=None) -> ProposedTree:
        """The tree of the scheduled drafts (``ProposedTrees.tree_for``)."""
        return self.proposed.tree_for(req_id, scheduled, shape)

    def proposed_here(self, req_id: str, scheduled: list[int]) -> bool:
        """Whether the scheduled drafts are (a prefix of) what this process proposed."""
        return self.proposed.proposed_here(req_id, scheduled)

    def forget(self, req_ids) -> None:
        """Finished requests: drop their trees and deferred drafter inputs."""
        for r in req_ids:
            self.proposed.pop(r, None)
        self.deferred.forget(req_ids)
        if self.grammars is not None:
            self.grammars.forget(req_ids)

