"""An oracle drafter for integration tests.

A random drafter almost never guesses right, so it leaves acceptance, bonus
tokens and KV compaction untested. The oracle wraps the real tree drafter (which
still runs: first pass, tree levels, side-buffer attention) and then replaces
each request's tree with one that hides the target's own greedy continuation
(known from a run without speculation) along a random branch, at random sibling
ranks and depths up to 8, among decoy nodes. Acceptance therefore goes deep and
the accepted path is rarely contiguous.

If the engine's output ever departs from the reference, the oracle simply keeps
proposing the reference's tokens: acceptance drops and the test comparing the
outputs fails — the oracle cannot hide a wrong verification.
"""

from __future__ import annotations

import hashlib
import random
import types


def oracle_tree(rng: random.Random, truth: list[int], budget: int, vocab: int,
                max_depth: int = 8) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a BFS-ordered tree of ``budget`` nodes that contains
    ``truth[:h]`` as a root path for a random h (root = index 0)."""
    h = rng.randint(0, min(max_depth, len(truth), budget))
    # nodes: (depth, token, parent_key); keys are insertion ids, root = 0
    nodes = {0: (0, None, None)}
    children: dict[int, list[int]] = {0: []}
    true_path = [0]
    for d in range(1, h + 1):
        key = len(nodes)
        nodes[key] = (d, truth[d - 1], true_path[-1])
        children[true_path[-1]].append(key)
        children[key] = []
        true_path.append(key)
    while len(nodes) - 1 < budget:
        parent = rng.choice([k for k, v in nodes.items() if v[0] < max_depth])
        used = {nodes[c][1] for c in children[parent]}
        if parent in true_path and true_path.index(parent) < len(truth):
            used.add(truth[true_path.index(parent)])  # a decoy must not be the truth
        token = rng.randrange(vocab)
        if token in used:
            continue
        key = len(nodes)
        nodes[key] = (nodes[parent][0] + 1, token, parent)
        # Random sibling rank: insert the decoy anywhere among its siblings.
        children[parent].insert(rng.randint(0, len(children[parent])), key)
        children[key] = []
    # BFS order: by depth, siblings in their (shuffled) order.
    order, frontier = [], [0]
    while frontier:
        nxt = []
        for k in frontier:
            nxt.extend(children[k])
        order.extend(nxt)
        frontier = nxt
    index = {0: 0}
    for i, k in enumerate(order, start=1):
        index[k] = i
    tokens = [nodes[k][1] for k in order]
    parents = [index[nodes[k][2]] for k in order]
    return tokens, parents


def oracle_chain(rng: random.Random, truth: list[int], budget: int, vocab: int,
                 max_depth: int = 8) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a chain: ``truth[:h]`` for a random h, then decoys."""
    n = min(budget, max_depth)
    h = rng.randint(0, min(n, len(truth)))
    tokens = list(truth[:h])
    while len(tokens) < n:
        token = rng.randrange(vocab)
        if len(tokens) == h and h < len(truth) and token == truth[h]:
            continue  # the first decoy must not be the truth
        tokens.append(token)
    return tokens, list(range(n))


def trie_tree(trie: dict, context: tuple, budget: int,
              max_children: int | None = None) -> tuple[list[int], list[int]]:
    """BFS tree of the most frequent observed continuations of ``context``.

    ``trie`` maps a token tuple (output so far) to {next token: count}; children
    are ranked by count, best first, at most ``max_children`` a node (a drafter's
    top-k; None: every observed one). This is what a good drafter looks like at
    temperature > 0: several likely branches per node.
    """
    tokens, parents = [], []
    frontier = [(0, context)]
    while frontier and len(tokens) < budget:
        nxt = []
        for node, ctx in frontier:
            ranked = sorted(trie.get(ctx, {}).items(), key=lambda kv: -kv[1])
            for tok, _ in ranked[:max_children]:
                if len(tokens) >= budget:
                    break
                tokens.append(tok)
                parents.append(node)
                nxt.append((len(tokens), ctx + (tok,)))
        frontier = nxt
    return tokens, parents


def root_positions(propose_kwargs: dict):
    """[B] position of each request's new root, from the drafter's ``propose``
    arguments (the step's KV length minus its rejected drafts)."""
    cad = propose_kwargs["common_attn_metadata"]
    rejected = propose_kwargs.get("num_rejected_tokens_gpu")
    B = cad.batch_size()
    root = cad.seq_lens[:B].long()
    return root if rejected is None else root - rejected[:B].long()


def output_so_far(runner, b: int, state) -> tuple:
    """Request ``b``'s output at its new root, from inside ``propose``: the
    committed tokens plus what this step emitted."""
    emitted = [t for t in runner.last_sampled_token_ids[b].tolist() if t >= 0]
    return tuple(state.output_token_ids) + tuple(emitted)


def build_tries(reference: dict[str, list[list[int]]]) -> dict[str, dict]:
    """prompt key -> {output prefix: {next token: count}} from sampled outputs."""
    tries = {}
    for key, samples in reference.items():
        trie: dict = {}
        for out in samples:
            for k in range(len(out)):
                counts = trie.setdefault(tuple(out[:k]), {})
                counts[out[k]] = counts.get(out[k], 0) + 1
        tries[key] = trie
    return tries


def install(worker, reference: dict, seed: int = 0, vocab: int = 49152,
            mode: str = "greedy", max_children: int | None = None) -> bool:
    """collective_rpc target: wrap the worker's tree drafter with the oracle.

    mode "greedy": reference = {prompt ids joined by ',': greedy output ids}; the
        tree hides the greedy continuation among decoys.
    mode "chain": as "greedy", but every tree is a chain (verified by the
        device's causal kernel): the greedy continuation, then decoys.
    mode "trie": reference = {prompt key: list of sampled outputs}; the tree holds
        the most frequent observed continuations of the current output
        (``max_children`` of them a node at most).
    """
    from vllm_treespec.tree.proposed import ProposedTree

    runner = worker.model_runner
    drafter = runner.drafter
    original = drafter.propose
    rng = random.Random(seed)
    tries = build_tries(reference) if mode == "trie" else {}

    def propose(self, *args, **kwargs):
        drafts = original(*args, **kwargs)
        prefix = root_positions(kwargs)
        for b, req_id in enumerate(runner.input_batch.req_ids[:len(prefix)]):
            if not drafts[b]:
                continue  # not allowed a tree (sampling params) or budget 0
            state = runner.requests[req_id]
            key = ",".join(map(str, state.prompt_token_ids))
            if key not in reference:
                continue
            if mode == "trie":
                context = output_so_far(runner, b, state)
                tokens, parents = trie_tree(tries[key], context, len(drafts[b]),
                                            max_children)
            else:
                root_index = int(prefix[b]) - len(state.prompt_token_ids)
                truth = reference[key][root_index + 1:]
                shape = oracle_chain if mode == "chain" else oracle_tree
                tokens, parents = shape(rng, truth, len(drafts[b]), vocab)
            drafts[b] = tokens
            self.proposed[req_id] = ProposedTree(tokens, parents, [0.0] * len(tokens))
        return drafts

    drafter.propose = types.MethodType(propose, drafter)
    return True


def tree_metrics(worker) -> dict:
    """collective_rpc target: the worker's cumulative tree metrics."""
    return worker.model_runner.tree_metrics.total.summary()


def break_stochastic_acceptance(worker) -> bool:
    """collective_rpc target (negative control): replace lossless stochastic
    acceptance by greedy acceptance on the same distributions — the "silent
    greedy fallback at T>0" bug. Tests use it to show they can detect bias."""
    import torch

    from vllm_treespec.bench.tree_reference import node_table
    from vllm_treespec.engine import accept as engine_accept
    from vllm_treespec.tree import greedy_accept

    def greedy_instead(tree, probs, uniforms=None, noise=None, generator=None):
        if callable(probs):  # distributions on demand: every node's
            probs = node_table(probs, torch.arange(tree.batch_size, device=tree.device),
                               tree.tree_size)
        return greedy_accept(tree, torch.argmax(probs, dim=-1))

    engine_accept.stochastic_accept = greedy_instead
    return True


def shift_grammar_masks(scheduler) -> None:
    """Negative control of grammar trees (the engine core in this process): each
    scheduled tree's bitmask rows shifted by one node, so node i's logits row is
    masked with node i + 1's grammar state (the last row keeps its own)."""
    from vllm_treespec.vllm_glue.grammar_trees import GrammarTrees

    rows = GrammarTrees.rows

    def shifted(self, matcher, drafts, parents, vocab_size):
        out = rows(self, matcher, drafts, parents, vocab_size)
        out[:-1] = out[1:].copy()
        return out

    assert scheduler.grammar_trees is not None
    GrammarTrees.rows = shifted


SIBLING_RENORMALISATION = "uniforms[:, d] * (1.0 - mass_before) < p_kid"


def drop_sibling_renormalisation(worker) -> bool:
    """collective_rpc target (subtle negative control): a source mutant of
    ``stochastic_accept`` that accepts the j-th sibling with probability p(x_j)
    instead of p(x_j) / (1 - mass of the earlier siblings). Only a node's later
    children change: x_2 is emitted with probability (1 - p(x_1)) p(x_2) instead
    of p(x_2), the residual tokens gain what it loses; first children, chains and
    the residual draw itself stay exact."""
    import inspect

    from vllm_treespec.engine import accept as engine_accept
    from vllm_treespec.tree import accept

    source = inspect.getsource(accept.stochastic_accept)
    assert source.count(SIBLING_RENORMALISATION) == 1, "the mutated line changed"
    namespace = dict(vars(accept))
    exec(source.replace(SIBLING_RENORMALISATION, "uniforms[:, d] < p_kid"), namespace)
    engine_accept.stochastic_accept = namespace["stochastic_accept"]
    return True


def stream_seeded_plain_steps(worker) -> bool:
    """collective_rpc target (negative control): plain steps draw a seeded
    request's noise from its generator stream, as stock vLLM does, instead of
    the per-position noise tree steps use."""
    runner = worker.model_runner
    runner._seat_position_generators = runner._request_seeds  # seeds, nothing seated
    return True


def schedule_speculation(worker, off_steps: int, period: int, mode: str = "defer",
                         chain: bool = False) -> bool:
    """collective_rpc target: a deterministic adaptive budget that keeps
    speculation off for ``off_steps`` of every ``period`` drafting decisions and
    drafts full trees otherwise; records each request's first draft token per
    root position (``recorded_drafts``).

    mode "defer": the product's behaviour (off steps skip the drafter, the next
        drafting step catches its KV up);
    mode "reference": the drafter runs every step (nothing deferred);
    mode "drop": negative control: deferred inputs are thrown away instead of
        caught up, so the drafter's KV misses the off steps' positions.
    chain: drafting steps are in the budget's chain mode (the greedy chain,
        one-wide levels, verified whole) instead of full trees.
    """
    from vllm_treespec.policy import AdaptiveBudget

    runner = worker.model_runner
    drafter = runner.drafter
    cfg = runner.tree_cfg
    policy = AdaptiveBudget(cfg.num_nodes, cfg.depth, cfg.max_children, probe_every=0)
    calls = [0]

    def plan_depth(self, batch):
        calls[0] += 1
        depth = 0 if calls[0] % period < off_steps else cfg.depth
        self.last_depth, self.chain_mode = depth, chain and depth > 0
        return depth

    policy.plan_depth = types.MethodType(plan_depth, policy)
    policy.observe_step = lambda *a, **k: None  # no cost model: select keeps full trees
    runner.adaptive_budget = drafter.adaptive_budget = policy
    drafter.defer_when_off = mode != "reference"
    if mode == "drop":
        take = drafter.deferred.take
        drafter.deferred.take = lambda *a, **k: (take(*a, **k), [])[1]  # nothing caught up
    record: dict[str, list] = {}
    original = drafter.propose

    def propose(self, *args, **kwargs):
        drafts = original(*args, **kwargs)
        root = root_positions(kwargs)
        for b, req_id in enumerate(runner.input_batch.req_ids[:len(root)]):
            if drafts[b]:  # keyed by prompt: request ids differ between engines
                prompt = ",".join(map(str, runner.requests[req_id].prompt_token_ids))
                key = hashlib.sha256(prompt.encode()).hexdigest()[:12]
                record[f"{key}@{int(root[b])}"] = drafts[b][0]
        return drafts

    drafter.propose = types.MethodType(propose, drafter)
    worker._treespec_drafts = record
    return True


def recorded_drafts(worker) -> dict:
    """collective_rpc target: what ``schedule_speculation`` recorded, plus how many
    deferred drafter tokens were caught up, and how many dropped (bounded memory)."""
    drafter = worker.model_runner.drafter
    return {"drafts": worker._treespec_drafts, "caught_up": drafter.catch_up_tokens,
            "dropped": drafter.dropped_tokens}


def record_proposals(worker) -> bool:
    """collective_rpc target: record every request's draft tokens per root position
    (stock vLLM's proposer or the tree's alike), keyed by prompt hash@root."""
    runner = worker.model_runner
    drafter = runner.drafter
    original = drafter.propose
    record: dict[str, list[int]] = {}

    def propose(self, *args, **kwargs):
        drafts = original(*args, **kwargs)
        root = root_positions(kwargs)
        rows = drafts.tolist() if hasattr(drafts, "tolist") else drafts
        for b, req_id in enumerate(runner.input_batch.req_ids[:len(root)]):
            prompt = ",".join(map(str, runner.requests[req_id].prompt_token_ids))
            key = hashlib.sha256(prompt.encode()).hexdigest()[:12]
            record[f"{key}@{int(root[b])}"] = list(rows[b])
        return drafts

    drafter.propose = types.MethodType(propose, drafter)
    worker._treespec_proposals = record
    return True


def recorded_proposals(worker) -> dict:
    """collective_rpc target: what ``record_proposals`` recorded."""
    return worker._treespec_proposals


def inject_draft_faults(worker, every: int) -> bool:
    """collective_rpc target: every ``every``-th forward of the drafter model
    raises (first pass, tree level or catch-up alike)."""
    model = worker.model_runner.drafter.model
    forward = model.forward
    calls = [0]

    def failing_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] % every == 0:
            raise RuntimeError("injected drafter fault")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    return True


def restore_vllm_zero_drafts(worker) -> bool:
    """collective_rpc target (negative control): vLLM's own handling of a batch
    that does not fit the drafter (token-0 drafts, num_spec_tokens per request)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = worker.model_runner
    runner._copy_draft_token_ids_to_cpu = GPUModelRunner._copy_draft_token_ids_to_cpu.__get__(
        runner)
    return True


def count_chunk_faults(worker, control_pad_locals: int) -> bool:
    """collective_rpc target: count the worker thread's minor page faults inside
    the runner's fresh-chunk entries; every frame-stack chunk CPython maps there
    faults at least once. ``execute_model`` calls alternate between the shipped
    entry and one built with ``control_pad_locals`` pad locals (the negative
    control), so both are measured on the same steps of one engine."""
    import resource

    from vllm_treespec.vllm_glue import frame_stack
    from vllm_treespec.vllm_glue import runner as runner_module

    entries = {"shipped": frame_stack.call_on_fresh_chunk,
               "control": frame_stack._make_entry(control_pad_locals)}
    faults: dict[str, list[int]] = {"shipped": [], "control": []}
    turn = [0]

    def counted(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") != "execute_model":
            return entries["shipped"](fn, *args, **kwargs)
        name = ("shipped", "control")[turn[0] % 2]
        turn[0] += 1
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        try:
            return entries[name](fn, *args, **kwargs)
        finally:
            faults[name].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    runner_module.call_on_fresh_chunk = counted
    worker._treespec_chunk_faults = faults
    return True


def chunk_faults(worker) -> dict[str, list[int]]:
    """collective_rpc target: what ``count_chunk_faults`` counted, per entry call."""
    return worker._treespec_chunk_faults


def record_drafter_work(worker) -> bool:
    """collective_rpc target: per drafting step (``propose``), which batch rows
    may get a tree (``tree_allowed_mask``), the drafter forwards it ran and the
    tokens of each, the draft tokens it proposed per row, the rows its levels
    grew and those it caught up (issue 94: requests without a tree must cost
    nothing)."""
    runner = worker.model_runner
    drafter = runner.drafter
    steps: list[dict] = []
    current: dict = {}
    forward, grow, catch_up = drafter.model.forward, drafter.levels.grow, \
        drafter.paged.catch_up_pass

    def counted_forward(*args, **kwargs):
        current["forwards"] += 1
        ids = kwargs.get("input_ids")
        current["tokens"].append(None if ids is None else int(ids.shape[0]))
        return forward(*args, **kwargs)

    def recorded_grow(builder, level, parent_hidden, step):
        current["level_rows"] = step.batch_size
        return grow(builder, level, parent_hidden, step)

    def recorded_catch_up(cad, batch):
        current["caught_up_rows"] += sorted(set(batch.rows))
        return catch_up(cad, batch)

    def propose(self, *args, **kwargs):
        B = kwargs["common_attn_metadata"].batch_size()
        current.clear()
        current.update(allowed=runner.tree_allowed_mask(B), forwards=0, tokens=[],
                       level_rows=None, caught_up_rows=[])
        drafts = original(*args, **kwargs)
        steps.append(dict(current, drafts=[len(d) for d in drafts]))
        return drafts

    original = drafter.propose
    drafter.model.forward = counted_forward
    drafter.levels.grow = recorded_grow
    drafter.paged.catch_up_pass = recorded_catch_up
    drafter.propose = types.MethodType(propose, drafter)
    worker._treespec_drafter_work = steps
    return True


def recorded_drafter_work(worker) -> list[dict]:
    """collective_rpc target: what ``record_drafter_work`` recorded."""
    return worker._treespec_drafter_work
