"""The drafter's skipped passes, kept until speculation resumes.

EAGLE's drafter runs a "first pass" every step over the tokens the target just
verified, to write its own KV for them. While the adaptive budget keeps
speculation off, that pass would be pure overhead (a plain step would not pay
it), so the proposer skips it and *defers* its inputs here: per request, the
drafter input ids, positions and the target's combined hidden states, exactly as
the first pass would have read them. The next step that drafts first forwards
everything deferred in one batched pass (``catch_up``), which writes the
missing drafter KV; then its own first pass runs as usual.

Only draft quality depends on the drafter's KV (the verify step never reads it),
so none of this can change what is emitted; it keeps the drafts as good as if
the drafter had run every step. The deferred inputs of one request are bounded:
past ``max_tokens`` in all, the proposer catches up without drafting.
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
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._spans: dict[str, list[DeferredSpan]] = {}
        self.total_tokens = 0

    def __len__(self) -> int:
        return len(self._spans)

    def defer(self, req_ids: list[str], ids: torch.Tensor, positions: torch.Tensor,
              hidden: torch.Tensor, first: list[int], last: list[int]) -> None:
        """Keep rows ``first[b] .. last[b]`` (inclusive) of request ``req_ids[b]``."""
        pos = positions.tolist() if len(req_ids) else []
        for b, req_id in enumerate(req_ids):
            lo, hi = first[b], last[b] + 1
            if hi <= lo:
                continue
            spans = self._spans.setdefault(req_id, [])
            start = int(pos[lo])
            span = DeferredSpan(start, ids[lo:hi].clone(), hidden[lo:hi].clone())
            if spans and spans[-1].end == start:  # contiguous: one longer span
                prev = spans[-1]
                span = DeferredSpan(prev.start, torch.cat([prev.ids, span.ids]),
                                    torch.cat([prev.hidden, span.hidden]))
                spans[-1] = span
                self.total_tokens += hi - lo
            else:
                spans.append(span)
                self.total_tokens += hi - lo

    def take(self, req_ids: list[str], step_start: list[int] | None) -> CatchUpBatch | None:
        """Remove and return the deferred spans of the requests in this batch.

        ``step_start[b]``: the first position request b's current first pass
        covers (None: no pass follows). Deferred positions at or past it are
        dropped: that pass rewrites them (a preempted request's recompute).
        """
        rows, ids, positions, hidden, q_lens, s_lens = [], [], [], [], [], []
        for b, req_id in enumerate(req_ids):
            spans = self._spans.pop(req_id, None)
            if not spans:
                continue
            for span in spans:
                self.total_tokens -= span.ids.shape[0]
                limit = span.end if step_start is None else min(span.end, step_start[b])
                n = limit - span.start
                if n <= 0:
                    continue
                rows.append(b)
                ids.append(span.ids[:n])
                hidden.append(span.hidden[:n])
                positions.append(torch.arange(span.start, limit, device=span.ids.device))
                q_lens.append(n)
                s_lens.append(limit)
        if not rows:
            return None
        return CatchUpBatch(rows=rows, ids=torch.cat(ids), positions=torch.cat(positions),
                            hidden=torch.cat(hidden), query_lens=q_lens, seq_lens=s_lens)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            for span in self._spans.pop(r, ()):
                self.total_tokens -= span.ids.shape[0]
