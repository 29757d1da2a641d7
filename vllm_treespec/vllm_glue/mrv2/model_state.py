"""The target's ``ModelState`` with tree positions and the tree mask.

MRV2 computes the slot mappings from ``input_batch.positions`` before it calls the
model state, and ``execute_model`` lets the dict ``ModelState.prepare_inputs``
returns override the model's inputs: so the tree nodes' rotary positions
(``prefix + depth``) go to the model through ``prepare_inputs`` while slots, the
rejection sampler's positions and the drafter's prefill stay linear. The tree rows
ride on the target layers' attention metadata (``prepare_attn``); the drafter's
layers share that dict (its prefill reuses the target's metadata) and must stay
causal, so the target layers get a copy of the metadata object carrying the rows."""

from __future__ import annotations

import copy
from collections.abc import Callable

from vllm_treespec.engine.layout import set_tree_positions, verify_rows
from vllm_treespec.vllm_glue.mrv2.steps import TreeSteps


class TreeModelState:
    """Wraps MRV2's model state (every other attribute is the wrapped one's)."""

    def __init__(self, inner, steps: TreeSteps, draft_layers: set[str],
                 block_size: Callable[[], int]):
        self._inner = inner
        self._steps = steps
        self._draft_layers = draft_layers
        self._block_size = block_size  # known once the KV cache exists

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, for_capture=False, ubatch_idx=0,
                     *args, **kwargs):
        md = self._inner.prepare_attn(input_batch, cudagraph_mode, block_tables,
                                      slot_mappings, attn_groups, kv_cache_config,
                                      for_capture, ubatch_idx, *args, **kwargs)
        if for_capture or not md:
            return md
        # The first model-state call of a step (MRV2's execute_model): open it here.
        self._steps.begin(input_batch, block_tables[0], self._block_size())
        step = self._steps.step
        if step is None:
            return md
        # No spare blocks on MRV2 yet: a branching step takes the CPU backend's torch
        # tree attention (cpu_layout), exact, slower than the chain split.
        rows = verify_rows(step, input_batch.num_tokens, False, block_tables[0],
                           self._steps.block_size, [])
        copies: dict[int, object] = {}
        for name, meta in md.items():
            if name in self._draft_layers:
                continue
            if id(meta) not in copies:
                copies[id(meta)] = copy.copy(meta)
                copies[id(meta)].tree_verify = rows
            md[name] = copies[id(meta)]
        return md

    def prepare_inputs(self, input_batch, req_states):
        out = self._inner.prepare_inputs(input_batch, req_states)
        step = self._steps.step
        if step is None or step.tree.is_chain:
            return out  # a chain's depths are its linear positions
        if "positions" in out:
            raise NotImplementedError("eagle3_tree on MRV2: models with their own "
                                      "positions (M-RoPE) are not supported")
        positions = input_batch.positions.clone()  # slots were computed from the original
        set_tree_positions(step, positions)
        return dict(out, positions=positions)
