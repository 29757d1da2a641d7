"""The drafter's skipped passes, kept until speculation resumes.

EAGLE's drafter runs a "first pass" every step over the tokens the target just
verified, to write its own KV for them. While the adaptive budget keeps
speculation off, that pass would be pure overhead (a plain step would not pay
it), so the proposer skips it and *defers* its inputs here: per request, the
drafter input ids, positions and the target's hidden states, exactly as the
first pass would have read them (after a step that verified no drafts, the raw
auxiliary states, so that the off step runs no drafter layer at all; see
``DeferredDrafts``). The
next step that drafts first forwards everything deferred in batched passes
(``take``), which writes the missing drafter KV; then its own first pass runs as
usual.

Only draft quality depends on the drafter's KV (the verify step never reads it),
so none of this can change what is emitted; caught up, the drafts are as good as
if the drafter had run every step. The deferred inputs are bounded: past
``max_tokens`` for the batch's requests, the oldest are dropped (``trim``), each
request keeping its most recent ones; a decode step's rows share one copy,
and copies that finished requests left behind are compacted away (``defer``).
A batch that stays off for long (a wide batch, where speculation does not pay)
then runs no drafter layer at all, not even the fc over its prefill chunks, and
a request that drafts again catches up a bounded recent window.

Known gaps (output unaffected, acceptance can be lower): positions without
drafter KV. Those dropped above (for a request prefilled while off, possibly
most of its prompt), and those deferred by a request that finishes while off.
A later request that reuses such blocks from the prefix cache (a shared prefix,
a chat's next turn) drafts against the gap until the blocks are evicted.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch


@dataclasses.dataclass
class DeferredSpan:
    """Drafter inputs of consecutive positions ``start .. start + len - 1``."""

    start: int
    ids: torch.Tensor      # [n] drafter input ids
    hidden: torch.Tensor   # [n, d] target hidden states (raw or combined)

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    @property
    def end(self) -> int:
        return self.start + self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.hidden.shape[-1]


@dataclasses.dataclass  # no slots: a weakref finalizer counts what it holds
class StepRows:
    """The one-token pieces of one step, copied once for all its requests."""

    ids: torch.Tensor      # [k]
    hidden: torch.Tensor   # [k, d]


@dataclasses.dataclass(slots=True)
class DeferredRow:
    """The drafter input of one position: row ``row`` of a step's ``StepRows``.
    A decode step keeps one of these a request (no tensor op per request: two
    clones a request were one of an off step's largest costs of our own,
    benchmarks/RESULTS.md, "Copies from other requests")."""

    start: int
    step: StepRows
    row: int

    size = 1

    @property
    def end(self) -> int:
        return self.start + 1

    @property
    def width(self) -> int:
        return self.step.hidden.shape[-1]


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
    input width ``hidden_size`` (EAGLE-3's fc layer). A step that verified no
    drafts defers the raw states (the off step then costs no drafter layer at
    all); they are combined at catch-up, many rows per call."""

    def __init__(self, max_tokens: int, hidden_size: int | None = None, combine=None):
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.combine = combine
        self._spans: dict[str, list[DeferredSpan]] = {}
        self._tokens: dict[str, int] = {}  # deferred tokens per request
        # Rows held by live StepRows: a copy lives while any of its rows is
        # kept, so requests that finished or caught up can leave rows behind
        # that no one counts; past twice what is counted, ``_compact``.
        self._held = _HeldRows()

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def held_rows(self) -> int:
        return self._held.rows

    @property
    def total_tokens(self) -> int:
        return self.pending(self._spans)

    def pending(self, req_ids) -> int:
        """Deferred tokens of these requests."""
        return sum(self._tokens.get(r, 0) for r in req_ids)

    def defer(self, req_ids: list[str], ids: torch.Tensor, positions: torch.Tensor,
              hidden: torch.Tensor, first: list[int], last: list[int]) -> None:
        """Keep rows ``first[b] .. last[b]`` (inclusive) of request ``req_ids[b]``.

        One-row pieces (decode steps) are copied together, in one copy for the
        step, and kept as ``DeferredRow``s; longer ones (prefill chunks) are
        copied each on its own, so that trimming one frees its memory. A piece
        that starts at or before a kept one's end (the request was preempted
        and recomputes) supersedes the kept positions from there.
        """
        if not req_ids:
            return
        pos = positions.tolist()
        singles = [b for b in range(len(req_ids)) if last[b] == first[b]]
        step = None
        if singles:
            rows = torch.tensor([first[b] for b in singles], device=ids.device)
            step = StepRows(ids.index_select(0, rows), hidden.index_select(0, rows))
            self._held.rows += len(singles)
            weakref.finalize(step, self._held.release, len(singles))
        at = dict(zip(singles, range(len(singles))))
        for b, req_id in enumerate(req_ids):
            lo, hi = first[b], last[b] + 1
            if hi <= lo:
                continue
            start = int(pos[lo])
            piece = DeferredRow(start, step, at[b]) if b in at else \
                DeferredSpan(start, ids[lo:hi].clone(), hidden[lo:hi].clone())
            kept = self._spans.get(req_id)
            if kept is None:
                kept = self._spans[req_id] = []
            elif kept and kept[-1].end > start:  # a recompute: keep what precedes it
                kept[:] = [_head(p, n) for p in kept if (n := min(p.end, start) - p.start) > 0]
                self._tokens[req_id] = sum(p.size for p in kept)
            kept.append(piece)
            self._tokens[req_id] = self._tokens.get(req_id, 0) + (hi - lo)
        if self.held_rows > 2 * self.max_tokens and \
                self.held_rows > 2 * self.total_tokens:
            self._compact()

    def _compact(self) -> None:
        """Every request's kept rows copied into spans of its own, so that the
        step copies other requests left behind are freed (bounded memory)."""
        reader = RowReader([p for ps in self._spans.values() for p in ps
                            if isinstance(p, DeferredRow)])
        for req_id, kept in self._spans.items():
            kept[:] = _merged(kept, reader)

    def trim(self, req_ids: list[str], keep: int) -> int:
        """Drop all but the ``keep`` most recent deferred tokens of each of these
        requests; returns how many were dropped."""
        dropped = 0
        for req_id in req_ids:
            excess = self._tokens.get(req_id, 0) - keep
            if excess <= 0:
                continue
            kept = self._spans[req_id]
            while kept and excess >= kept[0].size:
                excess -= kept[0].size
                dropped += kept.pop(0).size
            if not kept:
                self.forget([req_id])
                continue
            if excess:  # copies: a view would keep the whole piece (a prefill chunk) alive
                head = kept[0]  # a span: a row (size 1) went whole above
                kept[0] = DeferredSpan(head.start + excess, head.ids[excess:].clone(),
                                       head.hidden[excess:].clone())
                dropped += excess
            self._tokens[req_id] = sum(p.size for p in kept)
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
        kept = [self._spans.pop(r, ()) for r in req_ids]
        for req_id in req_ids:
            self._tokens.pop(req_id, None)
        rows = RowReader([p for ps in kept for p in ps if isinstance(p, DeferredRow)])
        pieces = []  # (row, start, end, span)
        for b, ps in enumerate(kept):
            for span in map(self._combined, _merged(ps, rows)):
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


def raw_first_pass_inputs(target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                          cad, batch_size: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """(ids, first rows, last rows) of a step's first-pass inputs as vLLM's
    ``set_inputs_first_pass`` would lay them out (each request's ids shifted by
    one, its next token last), for deferring them without that call."""
    n = cad.num_actual_tokens
    starts = cad.query_start_loc_cpu[:batch_size + 1].tolist()
    last = [s - 1 for s in starts[1:]]
    if cad.max_query_len == 1:
        return next_token_ids[:batch_size], starts[:-1], last
    ids = torch.empty_like(target_token_ids[:n])
    ids[:n - 1] = target_token_ids[1:n]
    ids[torch.tensor(last, device=ids.device)] = next_token_ids[:batch_size]
    return ids, starts[:-1], last


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


def _head(piece, n: int):
    """The first ``n`` positions of a kept piece (a view: what precedes a recompute)."""
    if n >= piece.size:
        return piece
    return DeferredSpan(piece.start, piece.ids[:n], piece.hidden[:n])


class _HeldRows:
    """The count step copies' finalizers release (held apart from DeferredDrafts,
    which a finalizer would otherwise keep alive)."""

    def __init__(self):
        self.rows = 0

    def release(self, rows: int) -> None:
        self.rows -= rows


class RowReader:
    """Reads the ``DeferredRow``s of one catch-up out of their steps' copies:
    the rows wanted from each step selected once (per hidden width: raw target
    states, or combined after a verify step), then one index per run."""

    def __init__(self, rows: list[DeferredRow]):
        wanted: dict[int, tuple[StepRows, list[int]]] = {}
        for r in rows:
            wanted.setdefault(id(r.step), (r.step, []))[1].append(r.row)
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        joined: dict[int, int] = {}  # rows selected so far, per width
        self._where: dict[tuple[int, int], int] = {}  # (step, row) -> index in its width's table
        for key, (step, picked) in wanted.items():
            width = step.hidden.shape[-1]
            at = joined.get(width, 0)
            self._where.update(((key, row), at + k) for k, row in enumerate(picked))
            joined[width] = at + len(picked)
            index = torch.tensor(picked, device=step.ids.device)
            parts.setdefault(width, []).append((step.ids.index_select(0, index),
                                                step.hidden.index_select(0, index)))
        self._tables = {w: (torch.cat([i for i, _ in p]), torch.cat([h for _, h in p]))
                        for w, p in parts.items()}

    def read(self, rows: list[DeferredRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of one width (``_merged`` runs never mix widths)."""
        ids, hidden = self._tables[rows[0].width]
        index = torch.tensor([self._where[(id(r.step), r.row)] for r in rows],
                             device=ids.device)
        return ids.index_select(0, index), hidden.index_select(0, index)


def _merged(pieces, rows: RowReader) -> list[DeferredSpan]:
    """Consecutive pieces of one width joined into one span each (one copy, at
    catch-up)."""
    runs: list[list] = []
    for piece in pieces:
        last = runs[-1][-1] if runs else None
        if last is not None and last.end == piece.start and last.width == piece.width:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [_joined(run, rows) for run in runs]


def _joined(run: list, rows: RowReader) -> DeferredSpan:
    if len(run) == 1 and isinstance(run[0], DeferredSpan):
        return run[0]
    ids, hidden, pending = [], [], []
    for piece in run + [None]:
        if isinstance(piece, DeferredRow):
            pending.append(piece)
            continue
        if pending:  # a run of rows: one read
            i, h = rows.read(pending)
            ids.append(i)
            hidden.append(h)
            pending = []
        if piece is not None:
            ids.append(piece.ids)
            hidden.append(piece.hidden)
    return DeferredSpan(run[0].start, torch.cat(ids), torch.cat(hidden))
