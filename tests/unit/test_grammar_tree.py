"""Draft trees under a grammar (``vllm_treespec.engine.grammar``), with the
embedded target's real tokenizer (its files only; the model is never loaded)
and a JSON schema compiled by xgrammar, the backend vLLM serves structured
output with. The oracle for every node's mask is a fresh matcher fed the node's
path token by token."""

from __future__ import annotations

import json
import statistics
import timeit
import types

import pytest
import torch

from vllm_treespec.engine.grammar import (
    ForcedRun,
    ForcedText,
    GrammarError,
    advance,
    apply_masks,
    disallowed,
    forced_run,
    full_masks,
    graft_forced,
    only_token,
    walk_tree,
)
from vllm_treespec.tree import TreeBatch

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ANSWER = '{"name": "Bob", "age": 42}'
TEXT_PROB = 0.9


@pytest.fixture(scope="module")
def g():
    """The tokenizer, the compiled schema, and the answer's tokens (root first)."""
    from transformers import AutoTokenizer

    from vllm_treespec.assets import cache_home, ensure_target

    home = cache_home()
    home.mkdir(parents=True, exist_ok=True)
    target = ensure_target(home)
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(target)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA),
                                                              any_whitespace=False)
    answer = tok.encode(ANSWER)
    assert tok.decode(answer) == ANSWER
    stop = info.stop_token_ids[0]

    def piece(text: str) -> int:
        ids = tok.encode(text)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    return types.SimpleNamespace(tok=tok, V=vocab_size, info=info, compiled=compiled,
                                 answer=answer, root=answer[0], stop=stop, piece=piece,
                                 text=ForcedText.from_vocab(info.decoded_vocab, TEXT_PROB))


def matcher_at_root(g):
    """A matcher in the request's state: the root token (``{"``) accepted."""
    m = xgr.GrammarMatcher(g.compiled)
    assert m.accept_token(g.root)
    return m


def oracle_row(g, path) -> torch.Tensor | None:
    """The mask a fresh matcher gives after root + ``path``; None where the
    grammar rejects the path; every token allowed after the stop token."""
    m = matcher_at_root(g)
    for token in path:
        if m.is_terminated() or not m.accept_token(token):
            return None
    row = full_masks(1, g.V)
    if not m.is_terminated():
        m.fill_next_token_bitmask(row, 0)
    return row[0]


def state(m, vocab_size):
    """What a matcher's state shows: its next-token mask, whether it terminated,
    the text it forces."""
    row = full_masks(1, vocab_size)
    if not m.is_terminated():
        m.fill_next_token_bitmask(row, 0)
    return row.numpy().tobytes(), m.is_terminated(), m.find_jump_forward_string()


def bfs_lists(paths):
    """Draft paths (token tuples below the root) as BFS lists: by depth, in the
    order first named at each depth. Also the node id of every path."""
    prefixes = sorted(dict.fromkeys(p[:d] for p in paths for d in range(1, len(p) + 1)),
                      key=len)
    node = {(): 0, **{p: i + 1 for i, p in enumerate(prefixes)}}
    return [p[-1] for p in prefixes], [node[p[:-1]] for p in prefixes], node


def answer_tree(g):
    """The answer's drafts (and the stop token) as the main chain, with branches
    the grammar allows and branches it rejects. Returns the lists, node ids by
    path, and the paths expected invalid."""
    P = g.piece
    main = tuple(g.answer[1:]) + (g.stop,)
    at = {t: main[:main.index(P(t)) + 1] for t in ("name", "Bob", "4")}
    invalid = [(P("}"),),                  # an object cannot close before its keys
               (P("}"), P("name")),         # below a rejected draft
               at["name"] + (P(":"),),      # the key's closing quote is missing
               at["Bob"] + (P('"}'),),      # closes without the required "age"
               at["4"] + (P("."),),         # "age" is an integer
               main + (P("x"),)]            # after the stop token
    allowed = [(P("nam"),), at["name"] + (P('"'),), at["Bob"] + (P(" Smith"),),
               at["4"] + (P("}"),)]
    tokens, parents, node = bfs_lists([main] + allowed + invalid)
    return tokens, parents, node, {node[p] for p in invalid}, node[main]


def mismatched_nodes(g, node, masks) -> list[int]:
    """Nodes (``node``: id by path) whose row differs from the oracle's;
    rejected nodes skipped."""
    want = {i: oracle_row(g, path) for path, i in node.items()}
    return sorted(i for i, row in want.items()
                  if row is not None and not torch.equal(masks[i], row))


def test_walk_flags_the_drafts_the_grammar_rejects(g):
    tokens, parents, _, invalid, stop_node = answer_tree(g)
    walk = walk_tree(matcher_at_root(g), tokens, parents, g.V)
    assert {i for i, ok in enumerate(walk.valid) if not ok} == invalid
    # Below a valid node that has not terminated, a draft is valid exactly where
    # the node's row allows its token: the mask and the matcher agree.
    forbidden = disallowed(walk.masks, g.V)
    for i in range(1, len(tokens) + 1):
        p = parents[i - 1]
        if walk.valid[p] and p != stop_node:
            assert walk.valid[i] == (not bool(forbidden[p, tokens[i - 1]])), i
        else:
            assert not walk.valid[i], i


def test_each_nodes_mask_is_a_fresh_matchers_after_its_path(g):
    tokens, parents, node, invalid, stop_node = answer_tree(g)
    walk = walk_tree(matcher_at_root(g), tokens, parents, g.V)
    assert walk.masks.shape == (len(tokens) + 1, (g.V + 31) // 32)
    assert walk.masks.dtype == torch.int32
    assert mismatched_nodes(g, node, walk.masks) == []
    # After the stop token nothing is masked (vLLM's fill for a terminated grammar).
    assert bool((walk.masks[stop_node] == -1).all())
    # A rejected node's row is its parent's (its nearest valid ancestor's).
    for i in invalid:
        p = parents[i - 1]
        while p in invalid:
            p = parents[p - 1]
        assert torch.equal(walk.masks[i], walk.masks[p])
    # Negative control: the same rows one node off fail the comparison.
    shifted = torch.roll(walk.masks, 1, dims=0)
    assert len(mismatched_nodes(g, node, shifted)) > len(tokens) // 2


def test_the_walk_leaves_the_matcher_where_it_started(g):
    tokens, parents, *_ = answer_tree(g)
    m = matcher_at_root(g)
    before = state(m, g.V)
    walk_tree(m, tokens, parents, g.V, forced_cap=4, text=g.text)
    assert state(m, g.V) == before
    assert m.accept_token(g.answer[1])  # it goes on from the root, as before
    # Negative control: one token more and the state check sees it.
    assert state(m, g.V) != before


def test_a_walk_that_raises_still_restores_the_matcher(g):
    tokens, parents, *_ = answer_tree(g)
    m = matcher_at_root(g)
    before = state(m, g.V)

    fills = []

    class FailsOnSixthFill:  # the 6th fill: deep in the main chain, 5 tokens accepted
        def __getattr__(self, name):
            return getattr(m, name)

        def fill_next_token_bitmask(self, bitmask, index=0):
            fills.append(index)
            if len(fills) == 6:
                raise RuntimeError("fill failed")
            return m.fill_next_token_bitmask(bitmask, index)

    with pytest.raises(RuntimeError, match="fill failed"):
        walk_tree(FailsOnSixthFill(), tokens, parents, g.V)
    assert state(m, g.V) == before


def xgrammar_traversal(m, g, tokens, parents):
    """xgrammar's own tree walk (``traverse_draft_tree``, 0.2.8), as a call that
    returns its rows; None where this xgrammar lacks it."""
    if not hasattr(m, "traverse_draft_tree"):
        return None
    n = len(tokens) + 1
    first_child = torch.full((n,), -1, dtype=torch.int64)
    next_sibling = torch.full((n,), -1, dtype=torch.int64)
    for i in range(n - 1, 0, -1):  # backwards: each parent ends on its first child
        next_sibling[i] = first_child[parents[i - 1]]
        first_child[parents[i - 1]] = i
    ids = torch.tensor([g.root] + tokens)
    rows = torch.zeros(n, (g.V + 31) // 32, dtype=torch.int32)

    def run():
        assert m.traverse_draft_tree(first_child, next_sibling, ids, rows)
        return rows
    return run


def test_the_walk_agrees_with_xgrammars_own_tree_traversal(g):
    """A second, independent implementation of the rows. xgrammar leaves the rows
    of rejected nodes, and the row after the stop token, all zeros, where vLLM
    (and ``walk_tree``) reuse the last valid row / allow everything: those rows
    are compared apart."""
    tokens, parents, _, invalid, stop_node = answer_tree(g)
    m = matcher_at_root(g)
    traverse = xgrammar_traversal(m, g, tokens, parents)
    if traverse is None:
        pytest.skip("this xgrammar has no traverse_draft_tree")
    theirs = traverse()
    ours = walk_tree(m, tokens, parents, g.V)
    for i in set(range(len(tokens) + 1)) - invalid - {stop_node}:
        assert torch.equal(ours.masks[i], theirs[i]), i
    assert not bool(theirs[stop_node].any()) and bool((ours.masks[stop_node] == -1).all())


def test_forced_runs_follow_the_schema(g):
    P = g.piece
    m = matcher_at_root(g)
    before = state(m, g.V)
    # After {" the key is forced as text, not as a token: n, na, nam, name are all
    # allowed, so no single token is forced.
    assert forced_run(m, 8, g.V).tokens == []
    run = forced_run(m, 8, g.V, g.text)
    assert g.tok.decode(run.tokens) == 'name": "'
    assert run.tokens == [P("name"), P('":'), P(' "')]
    assert run.probs == [TEXT_PROB] * 3
    assert forced_run(m, 2, g.V, g.text).tokens == run.tokens[:2]  # the cap
    assert state(m, g.V) == before
    # After the closing brace only the stop token is allowed: certain.
    assert advance(m, g.answer[1:]) == len(g.answer) - 1
    row = full_masks(1, g.V)
    m.fill_next_token_bitmask(row, 0)
    assert only_token(row[0], g.V) == g.stop
    assert forced_run(m, 8, g.V) == forced_run(m, 8, g.V, g.text) == ForcedRun([g.stop], [1.0])
    # Negative control: inside the string nothing is forced.
    m2 = matcher_at_root(g)
    advance(m2, [P("name"), P('":'), P(' "')])
    assert forced_run(m2, 8, g.V, g.text).tokens == []


def _checked(grafted, max_depth):
    """The grafted lists pass TreeBatch's invariants (BFS order, distinct siblings)."""
    n = len(grafted.tokens)
    TreeBatch.from_parents([[0] + grafted.tokens], [[0] + grafted.parents], tree_size=n + 1,
                           max_depth=max_depth).validate()
    return grafted


def test_grafted_runs_replace_rejected_drafts_and_extend_valid_ones(g):
    P = g.piece
    m = matcher_at_root(g)
    before = state(m, g.V)
    # The drafter proposed a closing brace (rejected) with a child.
    tokens, parents, probs = [P("}"), P("x")], [0, 1], [0.5, 0.4]
    walk = walk_tree(m, tokens, parents, g.V, forced_cap=8, text=g.text)
    out = _checked(graft_forced(tokens, parents, probs, walk, 16, 4, 8), 8)
    assert g.tok.decode(out.tokens) == 'name": "' and out.parents == [0, 1, 2]
    assert out.probs == pytest.approx([0.9, 0.81, 0.729])
    assert out.forced == [False, True, True, True] and out.index == [0, None, None]
    assert all(walk_tree(m, out.tokens, out.parents, g.V).valid)
    # The drafter proposed the key (valid): no graft at the root, its run below it.
    tokens, parents, probs = [P("name"), P("nam")], [0, 0], [0.8, 0.1]
    walk = walk_tree(m, tokens, parents, g.V, forced_cap=8, text=g.text)
    out = _checked(graft_forced(tokens, parents, probs, walk, 16, 4, 8), 8)
    assert out.index == [0, 1, 2]
    want_tokens, want_parents, _ = bfs_lists([(P("name"), P('":'), P(' "')),
                                              (P("nam"), P("e"), P('":'), P(' "'))])
    assert (out.tokens, out.parents) == (want_tokens, want_parents)
    # After "nam" the only allowed token is "e": certain, the rest is forced text.
    assert walk.runs[2].probs == [1.0, TEXT_PROB, TEXT_PROB]
    assert out.probs == pytest.approx([0.8, 0.1, 0.8 * 0.9, 0.1, 0.8 * 0.81,
                                       0.1 * 0.9, 0.1 * 0.81])
    assert out.forced == [False, False, False] + [True] * 5
    assert all(walk_tree(m, out.tokens, out.parents, g.V).valid)
    # Budgets: nodes in all, children of a node, depth.
    assert graft_forced(tokens, parents, probs, walk, 3, 4, 8).tokens == tokens + [P('":')]
    assert graft_forced(tokens, parents, probs, walk, 16, 4, 2).tokens[2:] == [P('":'),
                                                                               P("e")]
    assert graft_forced(tokens, parents, probs, walk, 16, 2, 8).tokens[:2] == tokens
    assert state(m, g.V) == before


def test_a_run_already_drafted_is_not_grafted_again(g):
    P = g.piece
    m = matcher_at_root(g)
    tokens, parents, probs = [P("name"), P('":'), P(' "')], [0, 1, 2], [0.9, 0.8, 0.7]
    walk = walk_tree(m, tokens, parents, g.V, forced_cap=8, text=g.text)
    # Each node up to the string forces the rest of the key; the node in the
    # string forces nothing.
    assert {node: run.tokens for node, run in walk.runs.items()} == {
        0: tokens, 1: tokens[1:], 2: tokens[2:]}
    out = graft_forced(tokens, parents, probs, walk, 16, 4, 8)
    assert (out.tokens, out.parents, out.probs) == (tokens, parents, probs)
    # Negative control: the same chain cut after the key gets the rest grafted.
    walk = walk_tree(m, tokens[:1], parents[:1], g.V, forced_cap=8, text=g.text)
    assert graft_forced(tokens[:1], parents[:1], probs[:1], walk, 16, 4, 8).tokens == tokens


def test_advance_takes_the_emitted_tokens_and_refuses_a_rejected_one(g):
    P = g.piece
    m = matcher_at_root(g)
    emitted = g.answer[1:5]  # accepted drafts and the bonus token
    assert advance(m, emitted) == 4
    assert state(m, g.V)[0] == oracle_row(g, emitted).numpy().tobytes()
    before = state(m, g.V)
    with pytest.raises(GrammarError, match=f"rejects emitted token {P('}')}"):
        advance(m, [P('",'), P("}")])  # the required "age" missing
    assert state(m, g.V) == before  # nothing taken
    # Tokens after the stop token are not the grammar's (vLLM ignores them too).
    assert advance(m, list(g.answer[5:]) + [g.stop, P("x")]) == len(g.answer) - 5 + 1
    assert m.is_terminated()


def test_a_finished_grammar_allows_no_drafts(g):
    tokens, parents, *_ = answer_tree(g)
    m = matcher_at_root(g)
    advance(m, list(g.answer[1:]) + [g.stop])
    walk = walk_tree(m, tokens, parents, g.V, forced_cap=4)
    assert walk.valid == [True] + [False] * len(tokens) and walk.runs == {}
    assert bool((walk.masks == -1).all())  # nothing constrains a finished request
    assert m.is_terminated()
    with pytest.raises(ValueError, match="a walk of 1 nodes"):
        graft_forced(tokens, parents, [1.0] * len(tokens),
                     walk_tree(m, [], [], g.V), 8, 4, 8)


def test_rows_unpack_and_apply_as_xgrammar_applies_them(g):
    tokens, parents, *_ = answer_tree(g)
    masks = walk_tree(matcher_at_root(g), tokens, parents, g.V).masks
    logits = torch.randn(masks.shape[0], g.V, generator=torch.Generator().manual_seed(0))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, masks)
    ours = apply_masks(logits.clone(), masks)
    assert torch.equal(ours, theirs)
    assert torch.equal(disallowed(masks, g.V), torch.isinf(theirs))
    # Logits wider than the grammar's vocabulary: the padding is never allowed.
    wide = apply_masks(torch.zeros(masks.shape[0], g.V + 7), masks)
    assert bool(torch.isinf(wide[:, g.V:]).all())
    # Negative control: one bit flipped changes one token's verdict.
    flipped = masks.clone()
    flipped[0, 0] ^= 1
    assert int((disallowed(flipped, g.V) != disallowed(masks, g.V)).sum()) == 1


def test_a_tree_must_be_in_bfs_order():
    with pytest.raises(ValueError, match="does not precede"):
        walk_tree(None, [5, 6], [0, 2], 64)
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        walk_tree(None, [5, 6], [0], 64)


def grown_tree(g, n: int):
    """``n`` drafts: the answer's chain, with siblings of its nodes (the next
    allowed tokens, and one rejected) until there are ``n``."""
    main = tuple(g.answer[1:]) + (g.stop,)
    paths, extra = [main], 0
    for d in range(len(main)):
        row = oracle_row(g, main[:d])
        allowed = (~disallowed(row.unsqueeze(0), g.V)[0]).nonzero().flatten().tolist()
        for t in [t for t in allowed if t != main[d]][:2] + [g.piece("x")]:
            if len(main) + extra < n and t != main[d] and main[:d] + (t,) not in paths:
                paths.append(main[:d] + (t,))
                extra += 1
    tokens, parents, _ = bfs_lists(paths)
    assert len(tokens) == n
    return tokens, parents


def _median_s(fn) -> float:
    return statistics.median(timeit.repeat(fn, number=1, repeat=15))


def test_walk_cost_of_a_32_node_tree(g):
    """Reported, not asserted (a shared 2-core machine times nothing reliably)."""
    tokens, parents = grown_tree(g, 32)
    m = matcher_at_root(g)
    walk = walk_tree(m, tokens, parents, g.V)
    valid = sum(walk.valid) - 1
    assert 0 < valid < 32  # both kinds of node are timed
    plain = _median_s(lambda: walk_tree(m, tokens, parents, g.V))
    forced = _median_s(lambda: walk_tree(m, tokens, parents, g.V, forced_cap=8,
                                         text=g.text))
    line = (f"\n[grammar walk] 32 drafts ({valid} valid): {plain * 1e3:.2f} ms "
            f"({plain / 33 * 1e6:.0f} us a node); with forced runs (cap 8, text): "
            f"{forced * 1e3:.2f} ms")
    traverse = xgrammar_traversal(m, g, tokens, parents)
    if traverse is not None:
        line += f"; xgrammar traverse_draft_tree: {_median_s(traverse) * 1e3:.2f} ms"
    print(line)
