"""The drafter's skipped passes, kept until speculation resumes.

EAGLE's drafter runs a "first pass" every step over the tokens the target just
verified, to write its own KV for them. While the adaptive budget keeps
speculation off, that pass would be pure overhead (a plain step would not pay
it), so the proposer skips it and *defers* its inputs here: per request, the
drafter input ids, positions and the target's hidden states, exactly as the
first pass would have read them (after a decode step, the raw auxiliary states,
so that the off step runs no drafter layer at all; see ``DeferredDrafts``). The
next step that drafts first forwards everything deferred in batched passes
(``take``), which writes the missing drafter KV; then its own first pass runs as
usual.

Only draft quality depends on the drafter's KV (the verify step never reads it),
so none of this can change what is emitted; caught up, the drafts are as good as
if the drafter had run every step. The deferred inputs are bounded: past
``max_tokens`` for the batch's requests, the oldest are dropped (``trim``), each
request keeping its most recent ones. A batch that stays off for long (a wide
batch, where speculation does not pay) then runs no drafter layer at all (only
the fc that combines a prefill chunk's states), and a request that drafts again
catches up a bounded recent window.

Known gaps (output unaffected, acceptance can be lower): positions without
drafter KV. Those dropped above (for a request prefilled while off, possibly
most of its prompt), and those deferred by a request that finishes while off.
A later request that reuses such blocks from the prefix cache (a shared prefix,
a chat's next turn) drafts against the gap until the blocks are evicted.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class DeferredSpan:
    """Drafter inputs of consecutive positions ``start .. start + len - 1``."""

    start: int
    ids: torch.Tensor      # [n] drafter input ids
    hidden: torch.Tensor   # [n, d] combined target hidden states

    @property
    def end(self) -> int:
        return self.start + self.ids.shape[0]


@dataclasses.dataclass
class CatchUpBatch:
    """One batched drafter pass over deferred spans (one span per row)."""

    rows: list[int]            # batch row (request index) of each span
    ids: torch.Tensor          # [N]
    positions: torch.Tensor    # [N]
    hidden: torch.Tensor       # [N, d]
    query_lens: list[int]
    seq_lens: list[int]        # span end: each span attends to everything before it


class DeferredDrafts:
    """``combine`` maps the target's raw auxiliary hidden states to the drafter's
    input width ``hidden_size`` (EAGLE-3's fc layer). A decode step defers the
    raw states (the off step then costs no drafter layer at all); they are
    combined at catch-up, many rows per call."""

    def __init__(self, max_tokens: int, hidden_size: int | None = None, combine=None):
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.combine = combine
        self._spans: dict[str, list[DeferredSpan]] = {}
        self._tokens: dict[str, int] = {}  # deferred tokens per request

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def total_tokens(self) -> int:
        return self.pending(self._spans)

    def pending(self, req_ids) -> int:
        """Deferred tokens of these requests."""
        return sum(self._tokens.get(r, 0) for r in req_ids)

    def defer(self, req_ids: list[str], ids: torch.Tensor, positions: torch.Tensor,
              hidden: torch.Tensor, first: list[int], last: list[int]) -> None:
        """Keep rows ``first[b] .. last[b]`` (inclusive) of request ``req_ids[b]``.

        Each call keeps one piece per request (no copying of what is kept
        already). A piece that starts at or before a kept one's end (the request
        was preempted and recomputes) supersedes the kept positions from there.
        """
        pos = positions.tolist() if len(req_ids) else []
        for b, req_id in enumerate(req_ids):
            lo, hi = first[b], last[b] + 1
            if hi <= lo:
                continue
            start = int(pos[lo])
            piece = DeferredSpan(start, ids[lo:hi].clone(), hidden[lo:hi].clone())
            kept = self._spans.setdefault(req_id, [])
            if kept and kept[-1].end > start:  # a recompute: keep what precedes it
                kept[:] = [DeferredSpan(p.start, p.ids[:n], p.hidden[:n]) for p in kept
                           if (n := min(p.end, start) - p.start) > 0]
                self._tokens[req_id] = sum(p.ids.shape[0] for p in kept)
            kept.append(piece)
            self._tokens[req_id] = self._tokens.get(req_id, 0) + (hi - lo)

    def trim(self, req_ids: list[str], keep: int) -> int:
        """Drop all but the ``keep`` most recent deferred tokens of each of these
        requests; returns how many were dropped."""
        dropped = 0
        for req_id in req_ids:
            excess = self._tokens.get(req_id, 0) - keep
            if excess <= 0:
                continue
            kept = self._spans[req_id]
            while kept and excess >= kept[0].ids.shape[0]:
                excess -= kept[0].ids.shape[0]
                dropped += kept.pop(0).ids.shape[0]
            if not kept:
                self.forget([req_id])
                continue
            if excess:  # copies: a view would keep the whole piece (a prefill chunk) alive
                head = kept[0]
                kept[0] = DeferredSpan(head.start + excess, head.ids[excess:].clone(),
                                       head.hidden[excess:].clone())
                dropped += excess
            self._tokens[req_id] = sum(p.ids.shape[0] for p in kept)
        return dropped

    def take(self, req_ids: list[str], step_start: list[int] | None,
             max_pass_tokens: int) -> list[CatchUpBatch]:
        """Remove the deferred spans of the requests in this batch and return them
        as drafter passes of at most ``max_pass_tokens`` tokens each, in order.

        ``step_start[b]``: the first position request b's current first pass
        covers (None: no pass follows). Deferred positions at or past it are
        dropped: that pass rewrites them (a preempted request's recompute). A
        long span is cut into consecutive pieces; a piece attends to everything
        before it, so pieces may share a pass (KV is written before attention)
        or follow in later ones.
        """
        pieces = []  # (row, start, end, span)
        for b, req_id in enumerate(req_ids):
            self._tokens.pop(req_id, None)
            for span in map(self._combined, _merged(self._spans.pop(req_id, ()))):
                end = span.end if step_start is None else min(span.end, step_start[b])
                for lo in range(span.start, end, max_pass_tokens):
                    pieces.append((b, lo, min(lo + max_pass_tokens, end), span))
        passes, current, size = [], [], 0
        for piece in pieces:
            n = piece[2] - piece[1]
            if current and size + n > max_pass_tokens:
                passes.append(_catch_up_batch(current))
                current, size = [], 0
            current.append(piece)
            size += n
        if current:
            passes.append(_catch_up_batch(current))
        return passes

    def _combined(self, span: DeferredSpan) -> DeferredSpan:
        if self.combine is None or span.hidden.shape[-1] == self.hidden_size:
            return span
        return DeferredSpan(span.start, span.ids, self.combine(span.hidden))

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self._spans.pop(r, None)
            self._tokens.pop(r, None)


def _catch_up_batch(pieces) -> CatchUpBatch:
    ids, hidden, positions = [], [], []
    for _, lo, hi, span in pieces:
        ids.append(span.ids[lo - span.start: hi - span.start])
        hidden.append(span.hidden[lo - span.start: hi - span.start])
        positions.append(torch.arange(lo, hi, device=span.ids.device))
    return CatchUpBatch(rows=[p[0] for p in pieces], ids=torch.cat(ids),
                        positions=torch.cat(positions), hidden=torch.cat(hidden),
                        query_lens=[hi - lo for _, lo, hi, _ in pieces],
                        seq_lens=[hi for _, _, hi, _ in pieces])


def _merged(pieces) -> list[DeferredSpan]:
    """Consecutive pieces of one width joined into one span each (one copy, at
    catch-up)."""
    runs: list[list[DeferredSpan]] = []
    for piece in pieces:
        last = runs[-1][-1] if runs else None
        if last is not None and last.end == piece.start and \
                last.hidden.shape[-1] == piece.hidden.shape[-1]:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [run[0] if len(run) == 1 else
            DeferredSpan(run[0].start, torch.cat([p.ids for p in run]),
                         torch.cat([p.hidden for p in run])) for run in runs]
