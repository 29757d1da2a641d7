"""Copy branches in served trees: found per request, priced, grafted, learned.

Every drafting step (not while the adaptive budget keeps speculation off:
``DraftHandOver.copies_wanted`` says why), each request's history -- its prompt
and output so far, through this step's new root -- is searched for the
continuations of its last tokens (``tree.copy_drafts``). The history is the
runner's token table plus the step's sampled tokens not yet written there
(``sampled_tail``); a request whose history does not end at its root gets no
copies, and is counted.

With the adaptive budget, a branch keeps the nodes whose live estimate
(``policy.copy_estimates``) reaches the threshold at which one more verified
token stops paying beside the drafter's selection (``selection.best_extension``).
The verify step reports how far the target accepted along each branch, which
is what the estimates learn from; the drafter's own estimates learn only from
the nodes it drafted (``eagle_outcome``).

With ``cross_request_tokens``, a request's last tokens are also looked up in
the outputs of finished requests of its tenant (``tree.shared_suffixes``; the
tenant is ``(cache_salt, LoRA adapter)``, which the scheduler hands the runner
with each new request, leaving out requests without a ``cache_salt`` unless
``cross_request_unsalted``: ``scheduling.attach_tenants``); those copies are
grafted beside the request's own (``OTHER`` nodes), priced by their tenant's
own live estimate (``TenantAcceptance``) on top of the rest of the step, each
tenant's apart (``lengths``). A request whose lookups stop paying looks up ever
more rarely (``LookupGate``).

The drafter's KV stays complete whatever source the accepted tokens came from:
its next first pass runs over every accepted token (stock EAGLE's catch-up of
an accepted chain), whether it drafted them or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_treespec.policy.copy_estimates import CopyAcceptance, LookupGate, TenantAcceptance
from vllm_treespec.tree.accept import Outcome
from vllm_treespec.tree.copy_drafts import (
    COPY, EAGLE, OTHER, CopyDraft, accepted_along, copy_continuations, graft, prune)
from vllm_treespec.tree.shared_suffixes import SharedSuffixes, Tenant
from vllm_treespec.vllm_glue.sampled_tail import SampledTail

# Matches of the last MAX_NGRAM .. MIN_NGRAM tokens (longest first), searched in
# the last HISTORY_WINDOW tokens of a request's own history: the search's cost
# per step is bounded whatever the context's length (its cost at this window:
# benchmarks/history/RESULTS-history.md,
# "Overhead of the tree core: the tables (moved from RESULTS, 2026-12-07)");
# 4096, as before, left long prompts' starts out of reach.
MIN_NGRAM, MAX_NGRAM = 2, 4
HISTORY_WINDOW = 32768
# What the store keeps of a finished request: its last FILED_TOKENS tokens.
FILED_TOKENS = 4096
UNKNOWN = object()  # the tenant of a request the scheduler never named: sees no one's


class CopySource:
    def __init__(self, branches: int, length: int, shared: SharedSuffixes | None = None,
                 file_prompts: bool = False, window: int = HISTORY_WINDOW):
        self.branches, self.length, self.window = branches, length, window
        self.estimates = CopyAcceptance(MAX_NGRAM, length)
        # Copies from other requests: the store, their estimates per tenant,
        # each running request's tenant and lookup gate, and whether prompts
        # are filed with outputs.
        self.shared = shared
        self.other_estimates = TenantAcceptance(MAX_NGRAM, length)
        self.file_prompts = file_prompts
        self.tenants: dict[str, Tenant] = {}
        self.gates: dict[str, LookupGate] = {}
        # This step's sampled tokens, as the runner recorded them (``sampled``).
        self._recent = SampledTail()

    def sampled(self, recent: SampledTail) -> None:
        """The runner's sampler output of this step, before vLLM's bookkeeping."""
        self._recent = recent

    def admit(self, tenants: Mapping[str, Tenant]) -> None:
        """New requests' tenants (req_id -> tenant), as the scheduler named them
        (``scheduling.attach_tenants``; a request it left out shares nothing)."""
        self.tenants.update(tenants)

    def file_finished(self, req_id: str, prompt: Sequence[int] | None,
                      output: Sequence[int]) -> None:
        """A finished request's output (and prompt, with ``cross_request_prompts``)
        into the store under its tenant, its last ``FILED_TOKENS`` tokens (filing
        is linear in the length, on the step that learns the request finished);
        a request of unknown tenant files nothing."""
        tenant = self.drop(req_id)
        if self.shared is None or tenant is UNKNOWN:
            return
        text = [*(prompt if self.file_prompts and prompt is not None else ()), *output]
        self.shared.add(tenant, text[-FILED_TOKENS:])

    def drop(self, req_id: str) -> Tenant:
        """Forget a request that finished; returns its tenant (or ``UNKNOWN``)."""
        self.gates.pop(req_id, None)
        return self.tenants.pop(req_id, UNKNOWN)

    def find(self, token_ids: np.ndarray, num_tokens: np.ndarray, roots: list[int],
             req_ids: Sequence[str] = (), rows: Sequence[int] | None = None,
             ) -> tuple[list[list[CopyDraft]], int]:
        """Copies per batch row of ``rows`` (None: every row), in their order
        (``roots``: each batch row's new root token; ``req_ids``: the rows'
        requests, whose tenants' outputs are searched too), and how many of
        those rows' histories did not end at their root (those get none). The
        rows left out are not searched at all: no lookup, no gate opened."""
        out, mismatches = [], 0
        for b in range(len(roots)) if rows is None else rows:
            root = roots[b]
            n = int(num_tokens[b])
            tail = self._recent.tail(b, n)  # [] : already in token_ids
            start = max(0, n + len(tail) - self.window)
            history = np.concatenate([token_ids[b, start:n], np.asarray(tail, np.int64)])
            if len(history) == 0 or history[-1] != root:
                mismatches += len(history) > 0
                out.append([])
                continue
            own = copy_continuations(history, MAX_NGRAM, MIN_NGRAM, self.length, self.branches)
            req_id = req_ids[b] if b < len(req_ids) else None
            out.append(own + self._others(req_id, history, own))
        self._recent = SampledTail()
        return out, mismatches

    def _others(self, req_id: str | None, history: np.ndarray,
                own: list[CopyDraft]) -> list[CopyDraft]:
        """Copies from the request's tenant's finished requests, less those the
        request's own copies already verify (a prefix of one); none on a step
        its gate skips."""
        tenant = self.tenants.get(req_id, UNKNOWN)
        if self.shared is None or tenant is UNKNOWN:
            return []
        gate = self.gates.setdefault(req_id, LookupGate())
        if not gate.open():
            return []
        gate.looked()
        return [CopyDraft(d.tokens, d.match, OTHER, tenant)
                for d in self.shared.find(tenant, history, self.branches)
                if not any(k.tokens[:len(d.tokens)] == d.tokens for k in own)]

    def estimates_of(self, draft: CopyDraft, tokens: int | None = None) -> np.ndarray:
        """A copy's live acceptance estimates (of its first ``tokens``; default
        all), by its source (and tenant)."""
        est = self.other_estimates.of(draft.tenant) if draft.source == OTHER else self.estimates
        return est.estimates(draft.match, len(draft.tokens) if tokens is None else tokens)

    def lengths(self, copies: list[list[CopyDraft]], policy, base_gain: float,
                base_nodes: int, base_chains: bool) -> list[list[int]]:
        """How many tokens of each copy to verify. Without a policy, all; with
        one, those whose estimate reaches the batch-wide threshold (``_price_group``).

        Copies from other requests are priced after the rest, tenant by tenant:
        first every request's own copies beside the drafter's selection, as if
        no store existed; then each tenant's store copies on top of that alone,
        never beside another tenant's. So whether one tenant's store had a hit
        changes no other tenant's verified copy nodes (docs/cross-request.md,
        "Tenants")."""
        if policy is None:
            return [[len(c.tokens) for c in cs] for cs in copies]
        kept = [[0] * len(cs) for cs in copies]
        q = [[self.estimates_of(c) for c in cs] for cs in copies]
        own = [[i for i, c in enumerate(cs) if c.source != OTHER] for cs in copies]
        base = _Base(base_gain, base_nodes, base_chains, (0,) * len(copies))
        base = _price_group(own, q, kept, policy, base)
        if any(own) and not any(kept[b][i] for b, row in enumerate(own) for i in row):
            self.estimates.forget()
        # Tenants in the batch's order: every tensor-parallel rank must keep the
        # same least-recently-used order of estimates, and a set's order is not.
        tenants: dict = {}
        for cs in copies:
            for c in cs:
                if c.source == OTHER:
                    tenants.setdefault(c.tenant, None)
        for tenant in tenants:
            group = [[i for i, c in enumerate(cs) if c.source == OTHER and c.tenant == tenant]
                     for cs in copies]
            _price_group(group, q, kept, policy, base)
            # A tenant none of whose copies were kept forgets, whatever other
            # tenants' did.
            if not any(kept[b][i] for b, row in enumerate(group) for i in row):
                self.other_estimates.of(tenant).forget()
        return kept

    def grafted(self, tokens: list[int], parents: list[int], probs: list[float],
                copies: list[CopyDraft], lengths: list[int], max_nodes: int,
                max_children: int, drafter_scale: float = 1.0):
        """A drafted tree's lists with the copies grafted in: (tokens, parents,
        draft probabilities -- 0 for nodes only a copy proposed, which the
        drafter's calibration must not count --, sources, branches). Past
        ``max_nodes`` (a full drafted tree: no room for a copy), the nodes least
        likely to be accepted go, copies and drafts ranked together: a drafted
        node by its draft probability times ``drafter_scale`` (the budget's
        calibration), a copy's by its live estimate."""
        g = graft(tokens, parents, copies, len(tokens) + sum(lengths), max_children, lengths)
        drafted = iter(probs)
        new_probs = [next(drafted) if s & EAGLE else 0.0 for s in g.sources]
        if len(g.tokens) > max_nodes:  # the common case has room: nothing to rank
            values = [min(drafter_scale * p, 1.0) for p in new_probs]
            for c, nodes in zip(copies, g.branches):
                for node, q in zip(nodes, self.estimates_of(c, len(nodes))):
                    values[node - 1] = max(values[node - 1], float(q))
            g, kept = prune(g, values, max_nodes)
            new_probs = [new_probs[i - 1] for i in kept]
        return (g.tokens, g.parents, new_probs, g.sources,
                [(c.match, nodes, c.source) for c, nodes in zip(copies, g.branches)])

    def observe(self, trees, paths: list[list[int]],
                req_ids: Sequence[str]) -> tuple[int, int, int]:
        """Verified trees (``ProposedTree``s) of the requests ``req_ids`` and
        their accepted paths (node ids from the first accepted draft): learn
        each branch's acceptance; returns the tokens accepted from nodes only
        copies proposed, one of them from the request's own history; from nodes
        only other requests' copies proposed; and from nodes the drafter and a
        copy both proposed."""
        own = other = both = 0
        for tree, path, req_id in zip(trees, paths, req_ids, strict=True):
            if not tree.branches:
                continue
            tenant = self.tenants.get(req_id, UNKNOWN)
            for match, nodes, source in tree.branches:
                if source != OTHER:
                    est = self.estimates
                elif tenant is not UNKNOWN:
                    est = self.other_estimates.of(tenant)
                else:  # never grafted: a request of unknown tenant gets no OTHER copies
                    continue
                if nodes:
                    est.observe(match, len(nodes), accepted_along(path, nodes))
            from_store = 0
            for node in path:
                src = tree.sources[node - 1]
                own += src & (EAGLE | COPY) == COPY
                from_store += src == OTHER
                both += src & EAGLE and src != EAGLE
            other += from_store
            # Only a token no other source proposed pays for the lookup: copies
            # that repeat the drafter's nodes are common and add nothing.
            if from_store and req_id in self.gates:
                self.gates[req_id].accepted()
        return own, other, both


@dataclass(frozen=True)
class _Base:
    """What a group of copies is priced beside: the selection's gain, nodes,
    whether every tree is a chain, and how many copies each row keeps already."""
    gain: float
    nodes: int
    chains: bool
    fixed: tuple[int, ...]


def _price_group(group: list[list[int]], q: list[list[np.ndarray]], kept: list[list[int]],
                 policy, base: _Base) -> _Base:
    """Price the copies ``group`` names (per row, indices into ``q``, their
    estimates) beside ``base``; write how many tokens of each to keep into
    ``kept``; return the base with them added.

    The nodes whose estimate reaches the threshold at which one more stops
    paying, priced two ways as the drafter's selection is: every copy, paying
    the branching extra where they make a request's tree branch (two copies
    part somewhere; a copy beside a drafted chain), or each request's first
    copy alone (beside no drafts, a chain for the causal kernel). The faster
    step wins: without this, two one-token copies at the root of an undrafted
    request were priced as chains and verified as trees, which under load cost
    more than they accepted (benchmarks/RESULTS.md, "Hybrid trees (copy
    branches)")."""
    rows = [[q[b][i] for i in idx] for b, idx in enumerate(group)]
    every = [e for row in rows for e in row]
    if not every:
        return base
    batch = len(rows)
    beside_chain = base.chains and base.nodes > 0
    several = any(len(row) + f > 1 for row, f in zip(rows, base.fixed) if row)
    threshold, rate = policy.copy_threshold(
        np.concatenate(every), base.gain, base.nodes, batch,
        branching=beside_chain or (base.chains and several))
    counts = [[int((e >= threshold).sum()) for e in row] for row in rows]
    firsts = [row[0] for row, f in zip(rows, base.fixed) if row and not f]
    if several and firsts:
        first, first_rate = policy.copy_threshold(
            np.concatenate(firsts), base.gain, base.nodes, batch, branching=beside_chain)
        if first_rate > rate:
            counts = [[int((e >= first).sum()) if i == 0 and not f else 0
                       for i, e in enumerate(row)] for row, f in zip(rows, base.fixed)]
    gain, nodes, fixed = base.gain, base.nodes, list(base.fixed)
    for b, (idx, row, ks) in enumerate(zip(group, rows, counts)):
        for i, e, k in zip(idx, row, ks):
            kept[b][i] = k
            gain, nodes, fixed[b] = gain + float(e[:k].sum()), nodes + k, fixed[b] + (k > 0)
    chains = base.chains and (nodes == base.nodes or (base.nodes == 0 and max(fixed) <= 1))
    return _Base(gain, nodes, chains, tuple(fixed))


def eagle_outcome(outcome: Outcome, trees, paths: list[list[int]]) -> Outcome | None:
    """What the verify step says of the drafter's own nodes: per tree that has
    any, the accepted drafts up to the first node only a copy proposed (the
    greedy chain likewise; it is censored where the path left the drafter's
    nodes at its tip). None if no tree has a drafted node."""
    acc, chain, censored = [], [], []
    for i, (tree, path) in enumerate(zip(trees, paths)):
        if tree.sources is None:
            acc.append(outcome.accepted[i])
            chain.append(outcome.chain_accepted[i])
            censored.append(outcome.chain_censored[i])
            continue
        if not any(s & EAGLE for s in tree.sources):
            continue
        drafted = 0
        while drafted < len(path) and tree.sources[path[drafted] - 1] & EAGLE:
            drafted += 1
        acc.append(drafted)
        chain.append(min(outcome.chain_accepted[i], drafted))
        censored.append(outcome.chain_censored[i] or outcome.chain_accepted[i] > drafted)
    return Outcome(acc, chain, censored) if acc else None
