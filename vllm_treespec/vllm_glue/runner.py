"""Tree verification inside vLLM's model runner. The mixin is device-agnostic;
a device runner adds only its KV-cache layout (``_kv_views``) and names its tree
attention backend (``_tree_attention_backend``, checked on every layer).

Per step, for requests whose scheduled draft tokens are a tree:

1. ``_prepare_inputs``: vLLM lays the root + draft nodes out linearly (slots
   ``P + i``); we rewrite their rotary positions to ``P + depth(i)`` after the
   slot mapping exists, and prepare the tree rows for the attention backend.
2. ``_build_attention_metadata``: the tree rows ride on the attention metadata.
3. ``_sample``: target distributions at the nodes -> acceptance -> commit: the
   accepted path's KV (every layer), input ids and hidden states are copied to
   the front (``P+idx_k -> P+k``, skipped when already there) and positions made
   linear again, so the scheduler's ``num_computed -= rejected`` and the
   drafter's first pass see an ordinary accepted chain.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
import torch

from vllm_treespec.policy import AdaptiveBudget
from vllm_treespec.tree import Outcome, apply_compaction
from vllm_treespec.attention import TreeVerifyRows
from vllm_treespec.engine.commit import commit_accepted
from vllm_treespec.engine.layout import verify_rows
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.vllm_glue.calibration import StepCostCalibration
from vllm_treespec.vllm_glue.copy_source import eagle_outcome
from vllm_treespec.vllm_glue.metrics import TreeMetrics
from vllm_treespec.vllm_glue import (
    grammar_trees, rank_agreement, stats_channel, support, versions)
from vllm_treespec.vllm_glue.frame_stack import call_on_fresh_chunk
from vllm_treespec.vllm_glue.host_heap import IdleHeapTrimmer
from vllm_treespec.vllm_glue.proposer import TreeEagleProposer
from vllm_treespec.vllm_glue.sampled_tail import SampledTail
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm
from vllm_treespec.vllm_glue.seeded_draws import seat_position_generators
from vllm_treespec.vllm_glue.tree_sampler import sample_with_trees, tree_safe
from vllm_treespec.vllm_glue.verify_inputs import make_verify_step


logger = logging.getLogger("vllm.treespec")


def distinct_kv_caches(caches, kv_views):
    """(cache, its K/V views) of every layer, each storage once: layers may share
    a cache, and a KV move done twice is wrong (a destination is also a source)."""
    seen = set()
    for cache in caches:
        if cache is None:
            continue
        views = kv_views(cache)
        if views[0].data_ptr() not in seen:
            seen.add(views[0].data_ptr())
            yield cache, views


class TreeRunnerMixin(StepCostCalibration):
    """Mixed into a vLLM model runner class; inert for batches without trees."""

    # Whether a verify step whose trees are all chains still needs the tree
    # metadata (Ascend's plans read it; the CPU's native kernel does not).
    chains_need_tree_metadata = True

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.tree_cfg = tree_config_from_vllm(vllm_config)
        self.grammar_trees = grammar_trees.walked_by_scheduler(vllm_config)
        if hasattr(self, "drafter"):
            self.drafter = self._tree_proposer_class()(vllm_config, self.device, self)
        self._verify: VerifyStep | None = None
        self.tree_metrics = TreeMetrics.from_vllm_config(vllm_config, self.tree_cfg)
        self.adaptive_budget: AdaptiveBudget | None = None
        if self.tree_cfg.adaptive and hasattr(self, "drafter"):
            cfg = self.tree_cfg
            # A static topology fixes the tree: no chain mode to price.
            self.adaptive_budget = AdaptiveBudget(cfg.num_nodes, cfg.depth, cfg.draft_width,
                                                  chains=not cfg.is_static,
                                                  parallel=cfg.draft == "parallel")
            self.drafter.adaptive_budget = self.adaptive_budget
        self._step_start: float | None = None
        self._step_tokens = 0
        self._step_is_decode = False
        self._step_branching = False  # some tree of this step is not a chain
        self._step_sampling = (0.0, False)  # seconds, by the tree sampler (``_sample``)
        # Cache blocks past the scheduler's, for the attention backend's per-step
        # scratch (see _CPUDevice); none unless a device reserves them.
        self.tree_spare_blocks: list[int] = []
        self.heap_trimmer = IdleHeapTrimmer()

    # ------------------------------------------------------------- cost model
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        support.check_kv_cache_groups(len(kv_cache_config.kv_cache_groups))
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        backends = [g.backend for groups in getattr(self, "attn_groups", ()) for g in groups]
        if backends:
            support.check_tree_backends(backends, self._tree_attention_backend())
        else:  # a device runner that keeps its backends elsewhere (unverified on Ascend)
            logger.warning("eagle3_tree: no attention groups to check for the tree backend")
        if not kwargs.get("is_profiling", args[0] if args else False):
            self._calibrate_kernels()
            self._calibrate_step_cost()

    def sample_tokens(self, grammar_output):
        out = call_on_fresh_chunk(super().sample_tokens, grammar_output)
        policy = self.adaptive_budget
        if policy is not None and self._step_start is not None and self._step_is_decode:
            drafted = getattr(self.drafter, "last_draft_seconds", 0.0)
            sampled, tree = self._step_sampling
            seconds, sampled = rank_agreement.timings(
                time.perf_counter() - self._step_start - drafted - sampled, sampled)
            policy.observe_step(self._step_tokens, seconds, branching=self._step_branching)
            policy.observe_sampling(self._step_tokens, sampled, tree)
        self._step_start = None
        metrics = getattr(self, "tree_metrics", None)
        return out if metrics is None else stats_channel.attach(out, metrics.take_payload)

    # ------------------------------------------------------------- device hooks
    def _tree_proposer_class(self) -> type:
        """The tree drafter class (a device may put it on its own EAGLE proposer)."""
        return TreeEagleProposer

    def _kv_views(self, cache) -> tuple[torch.Tensor, ...]:
        """[blocks, block_size, ...] views of one layer's K and V (device layout)."""
        raise NotImplementedError

    def _tree_attention_backend(self) -> type:
        """The attention backend class every layer must run in tree mode."""
        raise NotImplementedError

    def _kv_layer_views(self):
        """K/V views of every layer's cache, each storage once."""
        return (views for _, views in distinct_kv_caches(self.kv_caches, self._kv_views))

    # ------------------------------------------------------------- policy
    def tree_allowed_mask(self, num_reqs: int, later: bool = False) -> list[bool]:
        """Requests whose sampling parameters tree acceptance reproduces exactly;
        ``later``: now or once they have emitted more (pending ``min_tokens`` is
        the one refusal that ends; the drafter keeps such requests' inputs)."""
        out = []
        for req_id in self.input_batch.req_ids[:num_reqs]:
            state = self.requests.get(req_id)
            emitted = sys.maxsize if later or state is None else len(state.output_token_ids)
            out.append(state is not None
                       and tree_safe(state.sampling_params, emitted, self.grammar_trees))
        return out

    def take_draft_token_ids(self):
        # Structured requests' trees go to the scheduler with their shapes: it
        # walks their grammars down them (``grammar_trees``).
        out = super().take_draft_token_ids()
        if out is not None and self.grammar_trees and hasattr(self, "drafter"):
            grammar_trees.attach_parents(out, self.drafter, self.requests)
        return out

    # ------------------------------------------------------------- state
    def _update_states(self, scheduler_output):
        if hasattr(self, "drafter"):
            copies = self.drafter.copies
            if copies is not None and copies.shared is not None:
                self._file_finished(copies, scheduler_output)
            self.drafter.forget(scheduler_output.finished_req_ids)
            self._compile_grammars(scheduler_output)
        out = super()._update_states(scheduler_output)
        if scheduler_output.finished_req_ids and not self.requests:
            # The last requests just finished: the engine goes idle (see host_heap).
            trim = self.heap_trimmer.at_idle()
            if trim is not None:
                logger.info("eagle3_tree: engine idle, returned %.0f of %.0f MB resident "
                            "to the OS in %.1f ms", trim.returned / 2**20,
                            trim.resident_before / 2**20, trim.seconds * 1e3)
        return out

    def _compile_grammars(self, scheduler_output) -> None:
        """New structured requests that may get trees: their grammars compiled
        for the drafter from now (``draft_grammars``)."""
        grammars = self.drafter.grammars
        for new in scheduler_output.scheduled_new_reqs if grammars is not None else ():
            params = new.sampling_params
            if (getattr(params, "structured_outputs", None) is not None
                    and tree_safe(params, sys.maxsize, self.grammar_trees)):
                grammars.arrived(new.req_id, params)

    def _file_finished(self, copies, scheduler_output) -> None:
        """Cross-request copies: finished requests' text filed before vLLM drops
        their state, then new requests' tenants (``scheduling.attach_tenants``)
        noted: an id can be both when a request is aborted and sent again. In a
        fixed order (a set's order differs between processes): every
        tensor-parallel rank's store must stay the same."""
        for req_id in sorted(scheduler_output.finished_req_ids):
            state = self.requests.get(req_id)
            if state is None:
                copies.drop(req_id)
            else:
                copies.file_finished(req_id, state.prompt_token_ids, state.output_token_ids)
        copies.admit(getattr(scheduler_output, "tree_tenants", None) or {})
        self.tree_metrics.on_cross_request(copies.shared)

    # ------------------------------------------------------------- inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        spec_md = prepared[1]  # (logits_indices, spec_md, ...: see versions)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.array([len(drafts.get(r, ())) for r in self.input_batch.req_ids],
                              dtype=np.int64)
        # Cost-model samples: steps where every request decodes (no prefill chunk).
        self._step_is_decode = bool(np.all(num_scheduled_tokens == 1 + num_drafts))
        self._step_tokens = int(num_scheduled_tokens.sum())
        self._step_start = time.perf_counter()
        self._step_branching = False
        self._step_sampling = (0.0, False)
        self._verify = None
        if spec_md is not None and scheduler_output.scheduled_spec_decode_tokens:
            t0 = time.perf_counter()
            self._verify = make_verify_step(self, scheduler_output, spec_md)
            self._verify.prepare_s = time.perf_counter() - t0
        return prepared

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_cad = super()._build_attention_metadata(*args, **kwargs)
        step = self._verify
        if step is not None and attn_metadata:
            t0 = time.perf_counter()
            rows = self._tree_rows(step)
            step.prepare_s += time.perf_counter() - t0
            groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
            for per_layer in groups:
                for md in {id(m): m for m in per_layer.values()}.values():
                    md.tree_verify = rows
        return attn_metadata, spec_cad

    def _tree_rows(self, step: VerifyStep) -> TreeVerifyRows:
        self._step_branching = not step.tree.is_chain
        bt = self.input_batch.block_table[0]
        # Chains alone: the native kernel is exact, on a device that reads nothing more.
        return verify_rows(step, int(self.query_start_loc.np[step.num_reqs]),
                           self.chains_need_tree_metadata, bt.get_device_tensor(step.num_reqs),
                           bt.block_size, self.tree_spare_blocks)

    # ------------------------------------------------------------- forward
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        t0 = time.perf_counter()
        # On a fresh frame-stack chunk: see frame_stack (why, and what it saves).
        out = call_on_fresh_chunk(super().execute_model, scheduler_output,
                                  intermediate_tensors)
        state = getattr(self, "execute_model_state", None)
        if self._verify is not None and state is not None:
            self._verify.hidden_states = state.hidden_states
            self._verify.aux_hidden_states = state.aux_hidden_states
        self.tree_metrics.on_forward(time.perf_counter() - t0, self._verify)
        return out

    # ------------------------------------------------------------- sample
    def _sample(self, logits, spec_decode_metadata):
        seeds = self._seat_position_generators()
        out = self._sample_tree_or_stock(logits, spec_decode_metadata, seeds)
        # Emitted tokens of this step ([B, width], -1 padded) for the drafter's
        # bookkeeping and traces, before vLLM's own bookkeeping runs.
        self.last_sampled_token_ids = out.sampled_token_ids
        drafter = getattr(self, "drafter", None)
        copies = getattr(drafter, "copies", None)
        grammars = getattr(drafter, "grammars", None)
        readers = [r for r in (copies, grammars if grammars is not None and grammars.active
                               else None) if r is not None]
        if readers:  # each request's history, as of now (``sampled_tail``)
            recent = SampledTail(out.sampled_token_ids, self.input_batch.num_tokens_no_spec)
            for reader in readers:
                reader.sampled(recent)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        # vLLM rewinds the generator of a seeded request whose sample it discards
        # (a prompt chunk) with set_offset, which CPU generators do not have: stock
        # vLLM-CPU (every supported release) kills the engine there. Ours are reseeded for the
        # position they sample next on every step (_seat_position_generators), so no rewind is
        # needed: those generators sit out vLLM's loop.
        gens, mask = self.input_batch.generators, getattr(self, "discard_request_mask", None)
        if not gens or mask is None:
            return super()._bookkeeping_sync(*args, **kwargs)
        discarded = np.nonzero(mask.np[:self.input_batch.num_reqs])[0]
        held = {int(b): gens.pop(int(b)) for b in discarded
                if int(b) in gens and gens[int(b)].device.type == "cpu"}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            gens.update(held)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False):
        # When a batch does not fit the drafter (a request within num_spec_tokens of
        # max_model_len), vLLM (every supported release) skips drafting and hands the scheduler
        # token-0 "zeroed" drafts, num_spec_tokens per request: for trees num_nodes (32), so
        # every request then verified ~31 junk tokens, accepted none, and under load
        # filled the KV cache and preempted (in the soak the tree server fell to a
        # small fraction of plain decoding's throughput).
        # No drafts instead; those requests decode plainly for the step.
        if not zeros_only:
            return super()._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only)
        self._draft_token_ids = [[] for _ in self.input_batch.req_ids]
        self._draft_token_req_ids = self.input_batch.req_ids.copy()

    def _request_seeds(self) -> dict[int, int]:
        """Batch row -> the request's seed, for the rows that have a generator."""
        batch = self.input_batch
        seeds = {b: self.requests[batch.req_ids[b]].sampling_params.seed
                 for b in batch.generators}
        return {b: s for b, s in seeds.items() if s is not None}

    def _seat_position_generators(self) -> dict[int, int]:
        """Seeded rows' generators keyed to the position they sample next (see
        ``seat_position_generators``); returns ``_request_seeds()``."""
        if not self.input_batch.generators:
            return {}
        seeds = self._request_seeds()
        seat_position_generators(self.input_batch.generators, seeds,
                                 self.input_batch.num_tokens_no_spec)
        return seeds

    def _sample_tree_or_stock(self, logits, spec_decode_metadata, seeds):
        step = self._verify
        if step is None or spec_decode_metadata is None:
            # No tree this step: a step without drafts is sampled as a plain one.
            spec_decode_metadata = versions.drafts_metadata(spec_decode_metadata)
            t0 = time.perf_counter()
            out = super()._sample(logits, spec_decode_metadata)
            self._step_sampling = (time.perf_counter() - t0, False)
            self.tree_metrics.on_plain_sample(self._step_sampling[0])
            return out
        t0 = time.perf_counter()
        self.input_batch.update_async_output_token_ids()
        out, acc = sample_with_trees(self.sampler, logits, spec_decode_metadata,
                                     self.input_batch.sampling_metadata, step, seeds)
        t1 = time.perf_counter()
        self._step_sampling = (t1 - t0, True)
        self._commit(step, acc)
        outcome = Outcome.of(step.tree, acc)
        req_ids = [self.input_batch.req_ids[i] for i in step.req_index.tolist()]
        forced = any(t.forced for t in step.proposed or ())
        # Accepted node ids of each tree, the first accepted draft first.
        paths = ([p[1: 1 + a] for p, a in zip(acc.path.tolist(), outcome.accepted)]
                 if forced or self.drafter.copies is not None else None)
        drafted = (outcome if self.drafter.copies is None
                   else self._observe_copies(step, outcome, paths, req_ids))
        if forced:
            self.tree_metrics.on_grammar(step.proposed, paths)
        if self.adaptive_budget is not None and drafted is not None:
            self.adaptive_budget.observe_acceptance(drafted, step.depth, step.predicted)
        self.tree_metrics.on_verify(step, acc, outcome.accepted, t1 - t0,
                                    time.perf_counter() - t1,
                                    None if self.tree_metrics.trace is None else req_ids)
        self._verify = None
        return out

    def _observe_copies(self, step: VerifyStep, outcome: Outcome, paths: list[list[int]],
                        req_ids: list[str]) -> Outcome | None:
        """Copy branches' acceptance learned and counted; returns what the
        drafter's own nodes accepted (``copy_source.eagle_outcome``)."""
        copies = self.drafter.copies
        self.tree_metrics.on_copies(*copies.observe(step.proposed, paths, req_ids))
        return eagle_outcome(outcome, step.proposed, paths)

    def _commit(self, step: VerifyStep, acc) -> None:
        bt = self.input_batch.block_table[0]
        commit_accepted(step, acc, bt.get_device_tensor(step.num_reqs), bt.block_size,
                        self._move_kv, self.input_ids.gpu, self.positions)

    def _move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV of (block, offset) pairs ``src`` [N, 2] copied to ``dst``, every layer."""
        for views in self._kv_layer_views():
            for view in views:
                apply_compaction(view, src, dst, block_dim=0, slot_dim=1)
