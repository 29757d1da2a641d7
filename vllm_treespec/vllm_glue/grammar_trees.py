"""Draft trees under a request's grammar, in vLLM's scheduler (structured output).

vLLM keeps each structured-output request's grammar in the scheduler process
(``StructuredOutputManager``): it cuts a chain's drafts at the first one the
grammar rejects (``update_draft_token_ids`` → ``validate_tokens``) and fills
one bitmask row per scheduled token and the bonus (``grammar_bitmask``), which
the worker applies to the matching logits rows (``apply_grammar_bitmask``).
A tree's rows are laid out the same way, one per node, so only the walk differs:

1. The worker hands each structured request's tree parents and draft
   probabilities to the scheduler beside its draft tokens
   (``attach_parents``: an attribute of vLLM's ``DraftTokenIds``).
2. ``GrammarTrees.update_drafts`` walks the request's grammar down the tree
   (``engine.grammar.walk_tree``): drafts it rejects are cut with their
   subtrees, and the runs it forces are grafted as branches, up to
   ``grammar_forced_tokens`` tokens (``graft_forced``). The kept tree's shape
   is remembered.
3. ``GrammarTrees.bitmask`` fills each tree request's rows from a walk of the
   scheduled tree (the scheduler may have cut it to a BFS prefix): row ``i`` is
   the grammar's mask after the path root..node ``i``. vLLM's own
   ``apply_grammar_bitmask`` then masks each node's logits row in place, so
   acceptance reads every node's distribution under its own mask.
4. ``GrammarTrees.schedule`` names each scheduled tree's shape in the output
   (``tree_shapes``), so the workers verify the kept tree, not the proposed one.

Only xgrammar's matcher can be walked (``accept_token`` / ``rollback``); a
request on another backend, or whose grammar does not constrain its next token
yet (a reasoning parser's thinking part), gets no drafts for the step rather
than a chain cut of tree drafts (``validate_tokens`` would read the BFS list as a
chain and mask its rows so). The workers give no tree to such requests at all
where they can tell (``tree_sampler.tree_safe``); this is the scheduler's guard.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_treespec.engine.grammar import ForcedText, graft_forced, walk_tree

logger = logging.getLogger("vllm.treespec")

TREE_PARENTS = "tree_parents"  # DraftTokenIds attribute: {req_id: (parents, probs)}
TREE_SHAPES = "tree_shapes"    # SchedulerOutput attribute: {req_id: GrammarTree}
# Forced text split into tokens (``engine.grammar.ForcedText``): the target may
# pick another split of the same text, so such a token is priced below certain.
FORCED_TEXT_PROB = 0.9


@dataclasses.dataclass(frozen=True)
class GrammarTree:
    """A tree the grammar kept: per node (BFS, the root excluded) its parent,
    draft probability, and the proposed node it is (1-based; 0 where the
    grammar's forced run grafted it)."""

    parents: list[int]
    probs: list[float]
    origin: list[int]


def attach_parents(draft_token_ids: Any, drafter: Any, requests: dict) -> None:
    """The worker's half: the structured requests whose drafts are the tree
    ``drafter`` proposed (``TreeEagleProposer``) get ``{req_id: (parents, draft
    probabilities)}`` on vLLM's ``DraftTokenIds`` (a dataclass, pickled whole to
    the engine core); ``requests``: the runner's request states."""
    trees = {}
    for req_id, tokens in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
        params = getattr(requests.get(req_id), "sampling_params", None)
        if (tokens and getattr(params, "structured_outputs", None) is not None
                and drafter.proposed_here(req_id, tokens)):
            tree = drafter.proposed[req_id]
            trees[req_id] = (tree.parents[:len(tokens)], tree.probs[:len(tokens)])
    if trees:
        setattr(draft_token_ids, TREE_PARENTS, trees)


def walked_by_scheduler(vllm_config: Any) -> bool:
    """Whether a tree engine gives structured-output requests trees: unless a
    reasoning parser holds their grammars off (``enable_in_reasoning`` false),
    where the scheduler could walk none until the thinking part ends and every
    tree drafted before would be dropped."""
    so = getattr(vllm_config, "structured_outputs_config", None)
    return not (getattr(so, "reasoning_parser", "")
                and not getattr(so, "enable_in_reasoning", False))


class GrammarTrees:
    """A tree engine's scheduler's grammar walks (installed by ``install``)."""

    def __init__(self, scheduler: Any, forced_tokens: int, max_children: int,
                 num_nodes: int):
        self.scheduler = scheduler
        self.forced_tokens = forced_tokens
        self.max_children = max_children
        self.num_nodes = num_nodes
        self.shapes: dict[str, GrammarTree] = {}
        self._text: ForcedText | None = None

    def matcher(self, request: Any):
        """The request's xgrammar matcher, if its grammar constrains the next
        token (else None: no tree for the step)."""
        from vllm_treespec.vllm_glue import versions

        so = request.structured_output_request
        grammar = getattr(so, "grammar", None)
        matcher = getattr(grammar, "matcher", None)
        if matcher is None or grammar.is_terminated():
            return None
        manager = self.scheduler.structured_output_manager
        return matcher if versions.grammar_constrains_next(manager, request) else None

    def forced_text(self, grammar: Any) -> ForcedText | None:
        """Token texts for forced text, built once from the first grammar's
        tokenizer (all of an engine's grammars share it)."""
        if self._text is None and self.forced_tokens:
            info = getattr(getattr(grammar, "ctx", None), "tokenizer_info", None)
            if info is not None:
                self._text = ForcedText.from_vocab(info.decoded_vocab, FORCED_TEXT_PROB)
        return self._text

    def kept_drafts(self, request: Any, drafts: list[int], parents: list[int],
                    probs: list[float]) -> list[int]:
        """The drafts the grammar keeps, forced runs grafted; the shape remembered."""
        req_id = request.request_id
        self.shapes.pop(req_id, None)
        matcher = self.matcher(request)
        n = min(len(drafts), len(parents))
        if matcher is None or n == 0:
            return []
        vocab = self.scheduler.structured_output_manager.backend.vocab_size
        grammar = request.structured_output_request.grammar
        walk = walk_tree(matcher, drafts[:n], parents[:n], vocab, self.forced_tokens,
                         self.forced_text(grammar))
        kept = graft_forced(drafts[:n], parents[:n], probs[:n], walk, self.num_nodes,
                            self.max_children, self.num_nodes)
        origin = [0] * len(kept.tokens)
        for old, new in enumerate(kept.index):
            if old and new is not None:
                origin[new - 1] = old
        if kept.tokens:
            self.shapes[req_id] = GrammarTree(kept.parents, kept.probs, origin)
        return kept.tokens

    def update_drafts(self, original, draft_token_ids: Any) -> None:
        """``Scheduler.update_draft_token_ids``: tree requests walked here, the
        rest (and requests it would skip or clear) by vLLM."""
        trees = getattr(draft_token_ids, TREE_PARENTS, None) or {}
        if not trees:
            return original(draft_token_ids)
        rest_ids, rest_drafts = [], []
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.scheduler.requests.get(req_id)
            tree = trees.get(req_id)
            if (tree is None or request is None or request.is_finished()
                    or request.is_prefill_chunk or not request.use_structured_output):
                self.shapes.pop(req_id, None)
                rest_ids.append(req_id)
                rest_drafts.append(drafts)
                continue
            try:
                request.spec_token_ids = self.kept_drafts(request, list(drafts), *tree)
            except Exception:  # a speculation fault must not end the engine: no drafts
                logger.exception("eagle3_tree: the grammar walk of request %s's tree "
                                 "failed; it decodes without drafts this step", req_id)
                self.shapes.pop(req_id, None)
                request.spec_token_ids = []
        if rest_ids:
            original(type(draft_token_ids)(rest_ids, rest_drafts))

    def bitmask(self, original, requests: dict, structured_ids: list[str],
                spec_tokens: dict[str, list[int]]):
        """``StructuredOutputManager.grammar_bitmask``: vLLM fills every row,
        tree requests' drafts handed to it as padding (one row each, unmasked,
        no grammar advance); then their rows are filled from a walk of the tree."""
        trees = {r: spec_tokens[r] for r in structured_ids
                 if r in self.shapes and spec_tokens.get(r)}
        if not trees:
            return original(requests, structured_ids, spec_tokens)
        padded = dict(spec_tokens)
        padded.update({r: [-1] * len(t) for r, t in trees.items()})
        out = original(requests, structured_ids, padded)
        vocab = self.scheduler.structured_output_manager.backend.vocab_size
        start = 0
        for req_id in structured_ids:
            rows = 1 + len(spec_tokens.get(req_id, ()))
            drafts = trees.get(req_id)
            matcher = None if drafts is None else self.matcher(requests[req_id])
            if matcher is not None:
                parents = self.shapes[req_id].parents[:len(drafts)]
                out[start: start + rows] = self.rows(matcher, drafts, parents, vocab)
            start += rows
        return out

    def rows(self, matcher: Any, drafts: list[int], parents: list[int], vocab_size: int):
        """A scheduled tree's bitmask rows (root first), as numpy."""
        return walk_tree(matcher, drafts, parents, vocab_size).masks.numpy()

    def schedule(self, original, *args: Any, **kwargs: Any):
        """``Scheduler.schedule``: the output names each scheduled tree's shape;
        finished requests' shapes are dropped."""
        out = original(*args, **kwargs)
        for req_id in out.finished_req_ids:
            self.shapes.pop(req_id, None)
        setattr(out, TREE_SHAPES, {r: self.shapes[r] for r, d in
                                   out.scheduled_spec_decode_tokens.items()
                                   if d and r in self.shapes})
        return out


def install(scheduler: Any, tree_cfg: Any) -> GrammarTrees:
    """Wrap a tree engine's ``scheduler`` (its instance only) for grammar trees."""
    walks = GrammarTrees(scheduler, tree_cfg.grammar_forced_tokens, tree_cfg.max_children,
                         tree_cfg.num_nodes)
    manager = scheduler.structured_output_manager
    for owner, name, method in ((scheduler, "update_draft_token_ids", walks.update_drafts),
                                (scheduler, "schedule", walks.schedule),
                                (manager, "grammar_bitmask", walks.bitmask)):
        original = getattr(owner, name)
        setattr(owner, name, lambda *a, _m=method, _o=original, **k: _m(_o, *a, **k))
    scheduler.grammar_trees = walks
    return walks
