"""Drafter forwards over the paged KV cache, as stock EAGLE runs them.

Two kinds, both written into the drafter's paged cache at their own positions
and attended by vLLM's native kernel (so no tree metadata at all):

* catch-up passes: the first passes that off steps skipped (``deferred_drafts``),
  forwarded batched when drafting resumes;
* one-wide levels: a tree level that forwards one node per request (the
  chain's tip) is a stock EAGLE chain step. Its position lies past the
  committed prefix, in a slot the scheduler reserved for the drafts
  (lookahead = ``depth``: ``scheduling.reserve_tree_lookahead``); the next step's
  first pass (or catch-up) writes it again before it is read as prefix.

Held by ``TreeEagleProposer``; it runs on the proposer's vLLM ``EagleProposer``
state (the drafter model, metadata builders, slot-mapping buffers).
"""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata


class PagedForwards:
    def __init__(self, drafter):
        self.drafter = drafter

    def catch_up_pass(self, cad, batch) -> int:
        """Forward one pass of deferred drafter inputs (``DeferredDrafts.take``):
        they write the drafter KV that the skipped first passes did not.
        Returns the tokens forwarded."""
        d = self.drafter
        rows = torch.tensor(batch.rows, dtype=torch.long, device=d.device)
        self.forward(cad.block_table_tensor[rows], batch.query_lens, batch.seq_lens,
                     batch.positions.to(d.device), batch.ids.to(d.device),
                     batch.hidden.to(d.device))
        return sum(batch.query_lens)

    def first_pass_rows(self, cad, rows: list[int], first: list[int], last: list[int],
                        num_tokens: int):
        """The first pass over batch ``rows`` alone, rows ``first[b] .. last[b]``
        of the inputs ``set_inputs_first_pass`` laid out (``last[b]``: the row
        that samples the new root's children), run as a catch-up pass runs: a
        batch's requests that get no tree are not forwarded. Returns the
        drafter's (last_hidden, hidden) at each of these rows' ``last``."""
        d = self.drafter
        lens = [last[b] - first[b] + 1 for b in rows]
        index = torch.cat([torch.arange(first[b], last[b] + 1) for b in rows]).to(d.device)
        positions = d._get_positions(num_tokens)
        seq_lens = (positions[[last[b] for b in rows]] + 1).tolist()
        block_table = cad.block_table_tensor[torch.tensor(rows, device=d.device)]
        last_hidden, hidden = self.forward(block_table, lens, seq_lens, positions[index],
                                           d.input_ids[index], d.hidden_states[index])
        ends = torch.tensor(lens, device=d.device).cumsum(0) - 1
        return last_hidden[ends], hidden[ends]

    def forward(self, block_table: torch.Tensor, query_lens: list[int],
                       seq_lens: list[int], positions: torch.Tensor, input_ids: torch.Tensor,
                       hidden: torch.Tensor):
        """One drafter forward over ``query_lens[i]`` tokens of each of these
        requests (``block_table`` rows), ending at ``seq_lens[i]``: their K/V go
        to the paged cache at ``positions`` and they attend causally to it,
        as in a stock EAGLE drafting step."""
        d = self.drafter
        dev = d.device
        q_lens = torch.tensor(query_lens, dtype=torch.int32)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(q_lens, 0)
        span = torch.repeat_interleave(torch.arange(len(query_lens), device=dev),
                                       q_lens.to(dev).long())
        bs = d.block_size
        slots = block_table[span, positions // bs].long() * bs + positions % bs
        n = int(qsl[-1])
        paged_cad = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            num_reqs=len(query_lens), num_actual_tokens=n, max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_table_tensor=block_table,
            slot_mapping=slots, positions=positions)
        _, per_layer_md = d.build_per_group_and_layer_attn_metadata(paged_cad)
        with set_forward_context(per_layer_md, d.vllm_config, num_tokens=n,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=d._get_slot_mapping(n, slots)):
            return d.model(input_ids=input_ids, positions=positions, hidden_states=hidden)

    def chain_level(self, block_table: torch.Tensor, prefix_len: torch.Tensor, level,
                     parent_hidden: torch.Tensor):
        """Forward each request's chain tip (``level`` slot 0, child of slot 0 of
        ``parent_hidden``) as stock EAGLE drafts a chain: its K/V go to the paged
        cache at its own position, where the levels before it put theirs, and
        the native kernel attends causally. Those positions lie past the
        committed prefix, in the slots the scheduler reserved for the drafts;
        the next step's first pass (or catch-up) writes them again before they
        are read as prefix."""
        B = prefix_len.shape[0]
        positions = prefix_len + (level.depth - 1)
        seq_lens = (positions + 1).tolist()
        return self.forward(block_table, [1] * B, seq_lens, positions,
                                   level.tokens[:, 0].int(), parent_hidden[:, 0])
