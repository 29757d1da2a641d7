"""The scheduler's half of trees under a grammar (``vllm_glue.grammar_trees``), with
vLLM's own ``XgrammarGrammar`` around a real xgrammar matcher (the embedded
target's tokenizer, a JSON schema); the scheduler and the structured-output
manager are stand-ins holding only what the wrappers read. The oracle for every
bitmask row is a fresh matcher fed the node's path."""

from __future__ import annotations

import types

import numpy as np
import pytest

from vllm_treespec.engine.grammar import full_masks
from vllm_treespec.vllm_glue import grammar_trees, versions
from vllm_treespec.vllm_glue.grammar_trees import TREE_PARENTS, TREE_SHAPES, GrammarTrees

xgr = pytest.importorskip("xgrammar")

# The embedded tokenizer and the compiled two-key schema, as the walk's own tests use.
from tests.unit.test_grammar_tree import g  # noqa: E402,F401  (a module fixture)


def request(g, req_id, prefix='{"', structured=True):
    """A scheduler request whose grammar has accepted ``prefix`` (the tokens so far)."""
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    so = None
    if structured:
        grammar = XgrammarGrammar(vocab_size=g.V, matcher=xgr.GrammarMatcher(g.compiled),
                                  ctx=g.compiled)
        assert grammar.accept_tokens(req_id, g.tok.encode(prefix))
        so = types.SimpleNamespace(grammar=grammar)
    return types.SimpleNamespace(
        request_id=req_id, structured_output_request=so, use_structured_output=structured,
        is_prefill_chunk=False, spec_token_ids=[], is_finished=lambda: False)


class Manager:
    """vLLM's structured-output manager as the wrappers see it: the backend's
    vocabulary size, the reasoning gate, and the original ``grammar_bitmask``
    (which fills every row with everything allowed and records its input)."""

    def __init__(self, vocab, constrained=True):
        self.backend = types.SimpleNamespace(vocab_size=vocab)
        self.constrained, self.seen = constrained, None

    def _get_constraint_bounds(self, request, spec_tokens):
        return (0, 0) if self.constrained else (1, 1)

    def grammar_bitmask(self, requests, ids, spec_tokens):
        self.seen = dict(spec_tokens)
        return full_masks(sum(1 + len(spec_tokens.get(r, ())) for r in ids),
                          self.backend.vocab_size).numpy()


def scheduler(g, requests, constrained=True, forced=8):
    calls = []
    sched = types.SimpleNamespace(
        requests={r.request_id: r for r in requests},
        structured_output_manager=Manager(g.V, constrained),
        update_draft_token_ids=lambda d: calls.append((list(d.req_ids), d.draft_token_ids)),
        schedule=lambda: types.SimpleNamespace(
            finished_req_ids=set(),
            scheduled_spec_decode_tokens={r.request_id: list(r.spec_token_ids)
                                          for r in requests}))
    cfg = types.SimpleNamespace(grammar_forced_tokens=forced, max_children=4, num_nodes=16)
    walks = grammar_trees.install(sched, cfg)
    return sched, walks, calls


def drafts(g, *lists):
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds([r for r, _ in lists], [d for _, d in lists])


def oracle_row(g, prefix, path):
    m = xgr.GrammarMatcher(g.compiled)
    for t in g.tok.encode(prefix) + list(path):
        assert m.accept_token(t)
    row = full_masks(1, g.V)
    m.fill_next_token_bitmask(row, 0)
    return row.numpy()[0]


def test_a_structured_tree_is_cut_grafted_masked_and_named(g):
    t = g.tok.encode
    name, age, comma = t("name")[0], t("age")[0], t(",")[0]
    a = request(g, "a")
    plain = request(g, "p", structured=False)
    sched, walks, calls = scheduler(g, [a, plain])
    # Below the root ({"): `name` (allowed; the grammar then forces `": `...), `age`
    # and `,` (rejected: xgrammar keeps the schema's key order), and under `name`
    # a child `,` (rejected).
    tree = ([name, age, comma, comma], [0, 0, 0, 1], [0.5, 0.3, 0.1, 0.2])
    out = drafts(g, ("a", tree[0]), ("p", [5, 6]))
    setattr(out, TREE_PARENTS, {"a": (tree[1], tree[2])})
    sched.update_draft_token_ids(out)
    # The plain request's drafts went to vLLM's own update, alone.
    assert calls == [(["p"], [[5, 6]])]
    shape = walks.shapes["a"]
    kept = a.spec_token_ids
    assert kept[0] == name and age not in kept and comma not in kept
    assert shape.origin[0] == 1 and set(shape.origin[1:]) == {0}  # the rest forced
    assert all(p <= i for i, p in enumerate(shape.parents))  # BFS: parents first
    text = g.tok.decode([name] + [k for k, o in zip(kept, shape.origin) if o == 0])
    assert text.startswith('name":'), text
    # The schedule names the kept tree; the bitmask rows are each node's own mask.
    sched_out = sched.schedule()
    assert getattr(sched_out, TREE_SHAPES) == {"a": shape}
    rows = sched.structured_output_manager.grammar_bitmask(
        sched.requests, ["a"], sched_out.scheduled_spec_decode_tokens)
    assert sched.structured_output_manager.seen["a"] == [-1] * len(kept)  # no chain walk
    paths = {0: []}
    for i, (tok, par) in enumerate(zip(kept, shape.parents)):
        paths[i + 1] = paths[par] + [tok]
    for node, path in paths.items():
        assert np.array_equal(rows[node], oracle_row(g, '{"', path)), node
    # Control: the rows shifted by one node are not those masks.
    assert not all(np.array_equal(rows[n + 1], oracle_row(g, '{"', paths[n]))
                   for n in range(len(kept)))


def test_a_grammar_held_off_drops_the_tree_and_others_go_to_vllm(g):
    a = request(g, "a")
    sched, walks, calls = scheduler(g, [a], constrained=False)
    out = drafts(g, ("a", g.tok.encode("name")))
    setattr(out, TREE_PARENTS, {"a": ([0], [0.5])})
    sched.update_draft_token_ids(out)
    assert a.spec_token_ids == [] and "a" not in walks.shapes and calls == []
    # Without shapes attached, vLLM's own update gets the very object.
    plain = drafts(g, ("a", [1, 2]))
    sched.update_draft_token_ids(plain)
    assert calls == [(["a"], [[1, 2]])]


def test_the_reasoning_gate_is_read_from_either_release():
    new = types.SimpleNamespace(_get_constraint_bounds=lambda r, s: (0, 0))
    held = types.SimpleNamespace(_get_constraint_bounds=lambda r, s: (1, 1))
    old = types.SimpleNamespace(should_fill_bitmask=lambda r: True)
    assert versions.grammar_constrains_next(new, None)
    assert not versions.grammar_constrains_next(held, None)
    assert versions.grammar_constrains_next(old, None)


def test_the_worker_names_only_structured_trees_it_proposed():
    from vllm.v1.outputs import DraftTokenIds

    from vllm_treespec.tree.proposed import ProposedTree

    tree = ProposedTree([7, 8, 9], [0, 0, 1], [0.5, 0.4, 0.2])
    drafter = types.SimpleNamespace(proposed={"s": tree, "p": tree, "x": tree})
    drafter.proposed_here = lambda r, d: drafter.proposed[r].tokens[:len(d)] == list(d)
    params = {"s": object(), "p": None, "x": object()}
    requests = {r: types.SimpleNamespace(sampling_params=types.SimpleNamespace(
        structured_outputs=so)) for r, so in params.items()}
    out = DraftTokenIds(["s", "p", "x"], [[7, 8], [7, 8], [1, 2]])
    grammar_trees.attach_parents(out, drafter, requests)
    # Structured and its own tree (cut to the scheduled prefix): named. Unstructured,
    # or drafts that are not the tree proposed here: not.
    assert getattr(out, TREE_PARENTS) == {"s": ([0, 0], [0.5, 0.4])}


def test_a_failing_walk_drops_the_tree_not_the_engine(g, monkeypatch):
    a = request(g, "a")
    sched, walks, calls = scheduler(g, [a])

    def broken(*args, **kwargs):
        raise RuntimeError("walk fault")

    monkeypatch.setattr(grammar_trees, "walk_tree", broken)
    out = drafts(g, ("a", g.tok.encode("name")))
    setattr(out, TREE_PARENTS, {"a": ([0], [0.5])})
    sched.update_draft_token_ids(out)
    assert a.spec_token_ids == [] and "a" not in walks.shapes
