"""Bookkeeping of the drafter inputs deferred while speculation is off."""

import gc
import weakref

import pytest
import torch

from vllm_treespec.vllm_glue.deferred_drafts import DeferredDrafts, RowReader


def step(req_positions: list[list[int]], d: int = 4):
    """One step's first-pass inputs: rows laid out request after request; the
    ids and hidden rows encode their position so the test can follow them."""
    pos = torch.tensor([p for ps in req_positions for p in ps])
    first, last, at = [], [], 0
    for ps in req_positions:
        first.append(at)
        last.append(at + len(ps) - 1)
        at += len(ps)
    return pos + 1000, pos, pos.float().unsqueeze(1).expand(-1, d).clone(), first, last


def test_consecutive_steps_merge_into_one_span_per_request():
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[10], [20, 21, 22]])
    dd.defer(["a", "b"], ids, pos, hid, first, last)
    ids, pos, hid, first, last = step([[11], [23]])
    dd.defer(["a", "b"], ids, pos, hid, first, last)
    assert dd.total_tokens == 6 and len(dd) == 2
    (batch,) = dd.take(["b", "a"], step_start=[24, 12], max_pass_tokens=64)
    assert batch.rows == [0, 1]  # batch order, one span each
    assert batch.query_lens == [4, 2] and batch.seq_lens == [24, 12]
    assert batch.positions.tolist() == [20, 21, 22, 23, 10, 11]
    assert batch.ids.tolist() == [1020, 1021, 1022, 1023, 1010, 1011]
    assert batch.hidden[:, 0].tolist() == [20, 21, 22, 23, 10, 11]
    assert dd.total_tokens == 0 and len(dd) == 0 and dd.take(["a"], None, 64) == []


def test_rows_past_the_accepted_tokens_are_not_kept():
    """A verify step's rejected drafts follow the accepted ones: only rows up to
    ``last`` (the new root's input) are the drafter's inputs."""
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, _ = step([[30, 31, 32, 33]])
    dd.defer(["a"], ids, pos, hid, first, [1])
    assert dd.take(["a"], None, 64)[0].positions.tolist() == [30, 31]


def test_positions_the_next_pass_recomputes_are_dropped_and_gaps_split():
    """After a preemption the request's prefill restarts at an earlier position:
    deferred inputs at or past it are rewritten by that pass anyway."""
    dd = DeferredDrafts(max_tokens=100)
    for ps in ([5, 6], [7], [9]):  # position 8 was covered by a pass that ran
        ids, pos, hid, first, last = step([ps])
        dd.defer(["a"], ids, pos, hid, first, last)
    (batch,) = dd.take(["a"], step_start=[7], max_pass_tokens=64)
    assert batch.positions.tolist() == [5, 6] and batch.seq_lens == [7]
    assert dd.total_tokens == 0
    for ps in ([5, 6], [7], [9]):
        ids, pos, hid, first, last = step([ps])
        dd.defer(["a"], ids, pos, hid, first, last)
    (batch,) = dd.take(["a"], step_start=None, max_pass_tokens=64)
    assert batch.query_lens == [3, 1] and batch.seq_lens == [8, 10] and batch.rows == [0, 0]


def test_requests_outside_the_batch_wait_and_finished_ones_are_forgotten():
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[1], [2]])
    dd.defer(["a", "b"], ids, pos, hid, first, last)
    assert dd.take(["c", "a"], None, 64)[0].rows == [1]
    dd.forget(["b", "zzz"])
    assert dd.total_tokens == 0 and len(dd) == 0


def test_long_spans_are_cut_into_passes_that_fit_the_drafter_budget():
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([list(range(0, 7)), [50], [60, 61, 62]])
    dd.defer(["a", "b", "c"], ids, pos, hid, first, last)
    passes = dd.take(["a", "b", "c"], None, max_pass_tokens=4)
    assert [p.query_lens for p in passes] == [[4], [3, 1], [3]]
    assert [p.rows for p in passes] == [[0], [0, 1], [2]]
    assert [p.seq_lens for p in passes] == [[4], [7, 51], [63]]  # a piece sees all before it
    flat = [x for p in passes for x in p.positions.tolist()]
    assert flat == list(range(7)) + [50, 60, 61, 62]
    assert [x for p in passes for x in p.hidden[:, 0].tolist()] == flat
    assert [x - 1000 for p in passes for x in p.ids.tolist()] == flat


def test_a_recompute_supersedes_kept_positions_and_memory_is_counted():
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[10, 11, 12]])
    dd.defer(["a"], ids, pos, hid, first, last)
    ids, pos, hid, first, last = step([[11]])  # preempted, recomputing from 11
    dd.defer(["a"], ids, pos, hid, first, last)
    assert dd.total_tokens == 2 and dd.pending(["a", "b"]) == 2
    (batch,) = dd.take(["a"], None, max_pass_tokens=64)
    assert batch.positions.tolist() == [10, 11] and batch.query_lens == [2]
    assert dd.total_tokens == 0


def test_raw_target_states_are_combined_at_catch_up_in_one_call_per_run():
    """Decode steps defer the target's raw auxiliary states (width 8 here); the
    drafter's fc (``combine``) runs at catch-up, once per consecutive run, while
    pieces deferred already combined (width 4) pass through unchanged."""
    calls = []

    def combine(h):
        calls.append(h.shape[0])
        return h[:, :4] + h[:, 4:]

    dd = DeferredDrafts(max_tokens=100, hidden_size=4, combine=combine)
    ids, pos, hid, first, last = step([[10, 11]])          # after a verify step: combined
    dd.defer(["a"], ids, pos, hid, first, last)
    for p in (12, 13, 14):                                   # decode steps: raw
        ids, pos, hid, first, last = step([[p]], d=8)
        dd.defer(["a"], ids, pos, hid, first, last)
    assert dd.pending(["a"]) == 5 and calls == []
    (batch,) = dd.take(["a"], None, max_pass_tokens=64)
    assert calls == [3]
    assert batch.positions.tolist() == [10, 11, 12, 13, 14]
    assert batch.hidden.shape == (5, 4)
    assert batch.hidden[:, 0].tolist() == [10, 11, 24, 26, 28]


def test_trim_keeps_each_requests_most_recent_inputs():
    """Past the bound while off, the oldest deferred inputs go (a piece is cut
    where the kept window starts); what remains catches up as before."""
    dd = DeferredDrafts(max_tokens=100)
    for ps in ([[10, 11, 12], [40]], [[13], [41]], [[14], [42]]):
        ids, pos, hid, first, last = step(ps)
        dd.defer(["a", "b"], ids, pos, hid, first, last)
    ids, pos, hid, first, last = step([[7]])
    dd.defer(["c"], ids, pos, hid, first, last)
    assert dd.trim(["a", "b"], keep=4) == 1 and dd.pending(["a", "b"]) == 7
    assert dd.trim(["a", "b"], keep=2) == 3 and dd.pending(["a", "b", "c"]) == 5
    (batch,) = dd.take(["a", "b"], None, max_pass_tokens=64)
    assert batch.positions.tolist() == [13, 14, 41, 42]
    assert batch.ids.tolist() == [1013, 1014, 1041, 1042]
    assert batch.hidden[:, 0].tolist() == [13, 14, 41, 42]
    assert batch.seq_lens == [15, 43]
    assert dd.trim(["c"], keep=0) == 1 and len(dd) == 0 and dd.total_tokens == 0


def test_a_trimmed_piece_keeps_only_its_rows():
    """A cut prefill chunk must not keep the whole chunk alive (a view would)."""
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([list(range(64))], d=16)
    dd.defer(["a"], ids, pos, hid, first, last)
    dd.trim(["a"], keep=4)
    (span,) = dd._spans["a"]
    assert span.hidden.untyped_storage().nbytes() == 4 * 16 * span.hidden.element_size()
    assert span.ids.untyped_storage().nbytes() == 4 * span.ids.element_size()


def test_a_recompute_before_the_trimmed_window_replaces_it():
    """A preempted request recomputes from before its kept window: nothing kept
    survives past the recompute's start."""
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[10, 11, 12, 13, 14]])
    dd.defer(["a"], ids, pos, hid, first, last)
    dd.trim(["a"], keep=2)  # keeps 13, 14
    ids, pos, hid, first, last = step([[5, 6]])
    dd.defer(["a"], ids, pos, hid, first, last)
    assert dd.pending(["a"]) == 2
    (batch,) = dd.take(["a"], None, max_pass_tokens=64)
    assert batch.positions.tolist() == [5, 6]


def test_a_steps_one_token_pieces_share_one_copy_without_the_chunks_rows():
    """A decode step keeps one copy for all its requests (no tensor op a request);
    a prefill chunk in the same step is copied on its own, so the shared copy
    holds the one-token pieces only and trimming the chunk frees its memory."""
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[10], list(range(40, 72)), [20]], d=16)
    dd.defer(["a", "b", "c"], ids, pos, hid, first, last)
    (a,), (b,), (c,) = dd._spans["a"], dd._spans["b"], dd._spans["c"]
    assert a.step is c.step and a.step.hidden.shape == (2, 16)
    assert b.hidden.untyped_storage().nbytes() == 32 * 16 * b.hidden.element_size()
    hid.zero_()  # the caller's buffers are reused next step
    ids, pos, hid, first, last = step([[11], [72], [21]], d=16)
    dd.defer(["a", "b", "c"], ids, pos, hid, first, last)
    (batch,) = dd.take(["c", "a", "b"], None, max_pass_tokens=64)
    assert batch.query_lens == [2, 2, 33] and batch.rows == [0, 1, 2]
    flat = [20, 21, 10, 11] + list(range(40, 73))
    assert batch.positions.tolist() == flat and batch.hidden[:, 0].tolist() == flat
    assert batch.ids.tolist() == [x + 1000 for x in flat]


def test_one_token_pieces_of_both_widths_are_read_back_in_order():
    """A verify step that kept one row defers it combined (width 4); decode steps
    defer raw rows (width 8): each run reads from its own width's copies."""
    dd = DeferredDrafts(max_tokens=100, hidden_size=4, combine=lambda h: h[:, :4] + h[:, 4:])
    for p, d in ((10, 4), (11, 8), (12, 8), (13, 4), (14, 8)):
        ids, pos, hid, first, last = step([[p], [p + 50]], d=d)
        dd.defer(["a", "b"], ids, pos, hid, first, last)
    (batch,) = dd.take(["a", "b"], None, max_pass_tokens=64)
    assert batch.positions.tolist() == [10, 11, 12, 13, 14, 60, 61, 62, 63, 64]
    assert batch.hidden.shape == (10, 4)
    assert batch.hidden[:, 0].tolist() == [10, 22, 24, 13, 28, 60, 122, 124, 63, 128]
    assert batch.query_lens == [1, 2, 1, 1, 1, 2, 1, 1]


def test_step_copies_left_behind_by_finished_requests_are_compacted():
    """A step copy lives while any of its rows is kept: after the other requests
    of a long off stretch finish, one request's rows would keep every copy (all
    requests' rows) alive. Past twice what is counted, the rows are copied
    into the request's own spans and the step copies freed."""
    dd = DeferredDrafts(max_tokens=8)
    reqs = ["a", "b", "c", "d"]
    for p in range(6):  # 24 rows in 6 copies
        ids, pos, hid, first, last = step([[10 + p], [20 + p], [30 + p], [40 + p]])
        dd.defer(reqs, ids, pos, hid, first, last)
    assert dd.held_rows == 24 and dd.total_tokens == 24  # all counted: nothing to do
    dd.forget(["b", "c", "d"])
    assert dd.held_rows == 24 and dd.total_tokens == 6
    ids, pos, hid, first, last = step([[16]])
    dd.defer(["a"], ids, pos, hid, first, last)
    assert dd.held_rows == 0 and dd.total_tokens == 7
    (batch,) = dd.take(["a"], None, max_pass_tokens=64)
    assert batch.positions.tolist() == list(range(10, 17))
    assert batch.hidden[:, 0].tolist() == list(range(10, 17))
    assert batch.ids.tolist() == [1000 + p for p in range(10, 17)]


def test_a_discarded_store_is_freed_and_a_catch_up_reads_only_its_rows():
    """The copies' finalizers must not keep the store alive; a catch-up of some
    requests selects their rows, not whole step copies."""
    dd = DeferredDrafts(max_tokens=100)
    ids, pos, hid, first, last = step([[10], [20], [30]], d=16)
    dd.defer(["a", "b", "c"], ids, pos, hid, first, last)
    reader = RowReader([dd._spans["b"][0]])
    assert reader._tables[16][1].shape == (1, 16)
    gone = weakref.ref(dd)
    del dd
    gc.collect()
    assert gone() is None


# --- requests that get no tree (issue 94) ------------------------------------
def _off_drafter(allowed: list[bool], later: list[bool]):
    """A tree drafter whose runner says which rows may get a tree now
    (``allowed``) or later (``later``); any drafter work raises, and its budget
    records the batches it plans for."""
    import types

    from vllm_treespec.vllm_glue.hand_over import DraftHandOver
    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    def drafted(*args, **kwargs):
        raise AssertionError("the drafter ran")

    d = TreeEagleProposer.__new__(TreeEagleProposer)
    d.runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=[f"r{b}" for b in range(len(allowed))]),
        tree_allowed_mask=lambda n, later_=False, **kw: list(
            later if kw.get("later", later_) else allowed)[:n])
    d.planned = []
    d.adaptive_budget = types.SimpleNamespace(
        catch_up_pending=None, plan_depth=lambda batch: d.planned.append(batch) or 3)
    d.tree_cfg, d.defer_when_off, d.copies, d.proposed = None, True, None, {}
    d.deferred, d.dropped_tokens, d.last_depth = DeferredDrafts(64, 4), 0, 3
    d.hand_over = DraftHandOver(d)
    d.set_inputs_first_pass = d._first_pass = d._catch_up = drafted
    d.model = types.SimpleNamespace(combine_hidden_states=drafted)
    return d


def _propose_decode_step(d, batch: int, at: int = 10):
    """``_draft_trees`` after a decode step without drafts: one row a request,
    at position ``at``."""
    import types

    cad = types.SimpleNamespace(batch_size=lambda: batch, max_query_len=1,
                                num_actual_tokens=batch,
                                query_start_loc_cpu=torch.arange(batch + 1))
    ids = torch.arange(batch) + 100
    return d._draft_trees(0.0, 8, ids, torch.full((batch,), at),
                          torch.zeros(batch, 12), ids + 1, None, cad, None)


def test_a_batch_without_tree_requests_is_a_plain_step():
    """No request may get a tree: no plan, no drafter pass, no drafts; the
    request whose min_tokens is pending (r1) keeps its inputs for the catch-up
    at its first tree, the others (never a tree) keep none."""
    d = _off_drafter([False, False, False], later=[False, True, False])
    for at in range(10, 13):
        assert _propose_decode_step(d, 3, at) == [[], [], []]
    assert d.planned == [] and d.last_depth == 0
    assert d.deferred.pending(["r1"]) == 3 and d.deferred.pending(["r0", "r2"]) == 0


def test_the_plain_step_control_drafts_for_the_same_batch_with_tree_requests():
    """Negative control: the same batch, its requests allowed trees, is planned
    for and reaches the drafter (the fake raises there)."""
    d = _off_drafter([True, False, True], later=[True, True, True])
    with pytest.raises(AssertionError, match="the drafter ran"):
        _propose_decode_step(d, 3)
    assert d.planned == [2]  # the budget plans for the tree requests only


def test_hand_over_gives_the_trees_to_their_rows_and_none_to_the_others():
    import dataclasses
    import types

    from vllm_treespec.tree import TreeBatch
    from vllm_treespec.vllm_glue.hand_over import DraftHandOver

    d = types.SimpleNamespace(copies=None, adaptive_budget=None, last_depth=2, proposed={},
                              runner=types.SimpleNamespace(
                                  input_batch=types.SimpleNamespace(req_ids=["a", "b", "c"]),
                                  tree_allowed_mask=lambda n: [False, True, True]))
    trees = TreeBatch.from_parents([[5, 6, 7], [8, 9]], [[0, 0, 1], [0, 0]], tree_size=3)
    trees = dataclasses.replace(trees, score=torch.zeros(2, 3))  # draft probabilities 1
    drafts = DraftHandOver(d)(trees, torch.tensor([5, 5, 8]), [0, 0, 0], rows=[1, 2])
    assert drafts == [[], [6, 7], [9]]
    assert set(d.proposed) == {"b", "c"} and d.proposed["b"].parents == [0, 1]
