"""Greedy eagle3_tree output is token-identical to decoding without speculation.

Real SmolLM2-135M on the CPU, 25 chat prompts x 128 tokens (the chunked-prefill
and preemption tests: the first 12), with the oracle drafter (see ``oracle.py``)
so that trees are accepted deeply, at random branches, and the KV commit runs on
nearly every step.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import (
    GREEDY_TOKENS,
    SMALL_M_LINEAR_ENV,
    base_engine,
    run_engine,
    small_block_size,
)
from tests.integration.prompts import chat_token_ids

pytestmark = pytest.mark.vllm

MAX_TOKENS = GREEDY_TOKENS
TREE = {"method": "eagle3_tree", "num_nodes": 16, "depth": 6, "top_k": 4, "adaptive": False}


@pytest.fixture(scope="module")
def reference(greedy_reference):
    prompts, outputs = greedy_reference
    return prompts, outputs, {",".join(map(str, p)): o for p, o in zip(prompts, outputs)}


def tree_spec(target_dir, drafter, prompts, ref_map, seed, **engine):
    return {"engine": base_engine(target_dir, speculative_config=dict(TREE, model=str(drafter)),
                                  **engine),
            "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "oracle": {"reference": ref_map, "seed": seed}}


def assert_identical(outputs, expected):
    bad = [(i, next((k for k, (a, b) in enumerate(zip(o[0], e)) if a != b), None))
           for i, (o, e) in enumerate(zip(outputs, expected)) if o[0] != e]
    assert not bad, f"{len(bad)} prompts differ (prompt, first differing token): {bad}"


def assert_deep_acceptance(tree: dict, min_mean: float):
    assert tree["trees"] > 0
    assert tree["mean_accept_len"] >= min_mean, tree
    depth = tree["per_depth_acceptance"]
    assert len(depth) >= 6 and depth[5] > 0, f"no acceptance at depth 6: {tree}"


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tree_equals_plain_decoding(batch, target_dir, random_drafter, reference,
                                           engine_dir):
    prompts, expected, ref_map = reference
    extra = {}
    if batch == 1:
        # Prefix caching is on (vLLM's default). Asking the long last prompt twice,
        # with small (16- or 32-token) blocks, serves the second one's prompt from
        # the cache, so that tree is verified on top of cached KV, every full block
        # of it (stock EAGLE would recompute the last one: scheduling.py).
        # One request at a time: 8 prompts and the long one twice (the batch of 8
        # runs them all).
        prompts, expected = prompts[:8] + prompts[-1:] * 2, expected[:8] + expected[-1:] * 2
        extra = {"block_size": small_block_size()}
    spec = tree_spec(target_dir, random_drafter, prompts, ref_map, seed=batch,
                     max_num_seqs=batch, **extra)
    kernels = {}
    if batch == 8:  # nodes chosen by a depth-weighted rank: another tree, the same text
        spec["engine"]["speculative_config"]["depth_weight"] = 1.3
        # and every linear layer through the CPU's few-row dispatcher (conftest)
        kernels = {SMALL_M_LINEAR_ENV: "keep"}
    spec["batch"] = 1 if batch == 1 else "all"
    out = run_engine(spec, engine_dir, f"greedy_tree_b{batch}", extra_env=kernels)
    assert_identical(out["outputs"], expected)
    assert_deep_acceptance(out["tree"], min_mean=3.0)
    if batch == 1:
        # The resent prompt's hit: its full blocks short of its last token.
        whole = (len(prompts[-1]) - 1) // extra["block_size"] * extra["block_size"]
        assert out["prefix_cache_hits"] >= whole > 0, (
            f"{out['prefix_cache_hits']} prefix-cache hits, fewer than the {whole} "
            "tokens of the resent prompt's full blocks")


def test_greedy_trees_of_the_real_builder_on_the_shipped_head(target_dir, reference,
                                                              engine_dir):
    """The tests above verify the oracle's trees. Here the tree builder's own,
    drafted by the shipped head (no oracle, copies off): the same text as plain
    decoding, every scheduled tree the proposed one, drafts accepted, and
    accepted paths that leave the top-ranked chain -- tokens only a tree could
    have verified."""
    from vllm_treespec.assets import committed_drafter_dir

    prompts, expected, _ = reference
    prompts, expected = prompts[:8], expected[:8]
    trace = engine_dir / "greedy_shipped_head_trace"
    cfg = dict(TREE, model=str(committed_drafter_dir()), copy_branches=0,
               trace_dir=str(trace))
    out = run_engine({"engine": base_engine(target_dir, speculative_config=cfg,
                                            max_num_seqs=4),
                      "prompts": prompts,
                      "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS}},
                     engine_dir, "greedy_shipped_head")
    assert_identical(out["outputs"], expected)
    tree = out["tree"]
    assert tree["unmatched_trees"] == 0 and tree["placeholder_drafts"] == 0, tree
    assert tree["mean_tree_size"] == TREE["num_nodes"], tree  # adaptive off: full trees
    assert tree["mean_accept_len"] >= 2.0, tree
    verified = [r for f in trace.glob("steps-*.jsonl") for line in open(f)
                for r in json.loads(line)["requests"]]
    assert len(verified) == tree["trees"], (len(verified), tree)

    def off_chain(r) -> bool:  # a node of the path with an elder sibling
        parents = r["parents"][1:]  # of nodes 1..M (the root's own entry is 0 too)
        return any(parents.index(parents[n - 1]) != n - 1 for n in r["path"][1:])

    branched = sum(map(off_chain, verified))
    assert branched >= 0.1 * len(verified), (branched, len(verified))


def test_greedy_chains_on_the_causal_kernel(target_dir, random_drafter, reference, engine_dir):
    """Steps whose trees are all chains skip tree attention (the CPU kernel is
    causal, and a chain's slots and positions are linear): still identical."""
    prompts, expected, ref_map = reference
    spec = tree_spec(target_dir, random_drafter, prompts[:12], ref_map, seed=5)
    spec["oracle"]["mode"] = "chain"
    out = run_engine(spec, engine_dir, "greedy_tree_chains")
    assert_identical(out["outputs"], expected[:12])
    tree = out["tree"]
    assert tree["chain_steps"] == tree["steps"] > 0, tree
    assert tree["mean_accept_len"] > 3.0, tree


def test_chunked_prefill_truncated_trees_and_early_finishes(target_dir, random_drafter,
                                                            reference, engine_dir):
    """A 48-token step budget chunks every prompt and cuts trees short (the
    scheduler truncates drafts; BFS order keeps each prefix a tree); requests
    stop at different lengths, so batches mix prefill chunks, plain decodes,
    truncated and full trees."""
    prompts, expected, ref_map = reference
    # 12 prompts: every length of the pattern below, and more requests than the
    # batch's 8 slots, so later ones join a running batch mid-way.
    prompts, expected = prompts[:12], expected[:12]
    spec = tree_spec(target_dir, random_drafter, prompts, ref_map, seed=3,
                     max_num_batched_tokens=48, enable_chunked_prefill=True)
    lengths = [MAX_TOKENS - 7 * (i % 9) for i in range(len(prompts))]
    spec["max_tokens_per_prompt"] = lengths
    out = run_engine(spec, engine_dir, "greedy_tree_chunked")
    assert_identical(out["outputs"], [e[:n] for e, n in zip(expected, lengths)])
    assert out["tree"]["mean_tree_size"] < TREE["num_nodes"], "budget never truncated a tree"
    assert out["tree"]["mean_accept_len"] > 1.5


def test_preemption_and_recompute(target_dir, random_drafter, reference, engine_dir):
    """A KV cache too small for all requests forces preemption and recompute
    (768 tokens in small blocks against 8 running requests of up to ~170 tokens)."""
    prompts, expected, ref_map = reference
    prompts, expected = prompts[:12], expected[:12]
    block = small_block_size()
    spec = tree_spec(target_dir, random_drafter, prompts, ref_map, seed=4,
                     num_gpu_blocks_override=768 // block, block_size=block, max_model_len=512)
    out = run_engine(spec, engine_dir, "greedy_tree_preempt")
    assert_identical(out["outputs"], expected)
    assert out["preemptions"] > 0


def test_adaptive_budget_turns_off_useless_speculation(target_dir, reference, engine_dir,
                                                       tmp_path):
    """A drafter that is never right is never worth verifying: the adaptive
    budget (on by default) must stop speculating after its cost model has seen
    that, except for occasional probes — and the output stays identical. Its
    decisions are recorded: over the second half of the run, every step that
    drafted was a probe, and probes were a minority of the steps.

    The drafter's vocabulary holds no token of the greedy answers, so its
    acceptance is 0 by construction. A random head (right a few percent of the
    time) made the claim a matter of the machine: where a verified token is
    nearly free, a few percent of acceptance can pay for drafting (issue 83)."""
    from tests.integration.drafters import never_right_drafter

    prompts, expected, _ = reference
    drafter = never_right_drafter(target_dir, tmp_path / "never_right", expected)
    # Copies off: the subject is the drafter's speculation (copy branches are
    # priced by their own estimates, and a random drafter's answers repeat).
    spec = {"engine": base_engine(target_dir, speculative_config={
                "method": "eagle3_tree", "model": str(drafter), "num_nodes": 16,
                "depth": 6, "top_k": 4, "copy_branches": 0}),
            "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "record_plans": True}
    out = run_engine(spec, engine_dir, "greedy_tree_adaptive")
    assert_identical(out["outputs"], expected)
    tree = out["tree"]
    assert tree["trees"] > 0 and not any(tree["per_depth_acceptance"]), tree  # never right
    late = out["plans"][len(out["plans"]) // 2:]
    assert len(late) > 20, out["plans"]
    # Drafted, not a probe: each with what the budget priced (budget_hooks.decision_inputs).
    assert [p for p in late if p[1] > 0 and not p[2]] == [], late
    assert sum(p[2] for p in late) < 0.25 * len(late), late


def test_one_token_requests_joining_a_decode_batch(target_dir, random_drafter, tokenizer,
                                                   engine_dir):
    """vLLM's scheduler pads a request that joins running decodes with a single
    token to schedule (here: one-token prompts, admitted as slots free up) with
    -1 placeholder drafts. A tree engine's scheduler does not
    (``scheduling.disable_draft_padding``): no placeholder is verified. Where a
    vLLM pads all the same (the second run restores the padding), they are
    verified as token 0 and counted. And with ``validate_invariants``, a tree
    that fails a check is verified as a chain of the same drafts. The soak
    found both paths broken (an endless re-check, and a fallback chain verified
    under the old tree's mask). Two runs, both identical to plain decoding: the
    drafter's own trees (valid: nothing dumped), and the oracle's, which give a
    node more than ``top_k`` children (invalid: dumped, then verified as chains)."""
    prompts = chat_token_ids(tokenizer)[:3] + [[t] for t in (504, 1838, 28, 9519)]
    lengths = [60, 10, 60, 40, 12, 40, 40]
    plain = {"engine": base_engine(target_dir, max_num_seqs=3), "prompts": prompts,
             "sampling": {"temperature": 0.0, "max_tokens": 60}, "max_tokens_per_prompt": lengths}
    expected = [o[0] for o in run_engine(plain, engine_dir, "one_token_reference")["outputs"]]
    ref_map = {",".join(map(str, p)): o for p, o in zip(prompts, expected)}
    for name, oracle in (("drafter", False), ("oracle", True)):
        trace = engine_dir / f"one_token_trace_{name}"
        spec = tree_spec(target_dir, random_drafter, prompts, ref_map, seed=6, max_num_seqs=3)
        if not oracle:
            del spec["oracle"]
        spec["scheduler_pads_drafts"] = oracle
        # Copies off: a copy branch widens the children a node may have, and the
        # oracle's over-wide trees would then be valid.
        spec["engine"]["speculative_config"].update(validate_invariants=True,
                                                    trace_dir=str(trace), copy_branches=0)
        spec["max_tokens_per_prompt"] = lengths
        out = run_engine(spec, engine_dir, f"one_token_{name}")
        assert_identical(out["outputs"], expected)
        dumps = list(trace.glob("treespec-failure-*.json"))
        assert bool(dumps) == oracle, f"{name}: {len(dumps)} invariant dumps"
        steps = [json.loads(line) for f in trace.glob("steps-*.jsonl") for line in open(f)]
        # A verify step at prefix 0 is a one-token prompt padded with placeholders:
        # only where the padding was restored, and then counted, not silent.
        padded = any(r["prefix_len"] == 0 for s in steps for r in s["requests"])
        assert padded == oracle, name
        assert (out["tree"]["placeholder_drafts"] > 0) == oracle, (name, out["tree"])
        # KV reserved past the scheduled tokens: the tree's depth, not the node budget.
        assert out["scheduler"]["lookahead"] == 6, out["scheduler"]
        # each verified node's draft probability, as the node selection saw it
        probs = [r["draft_probs"] for s in steps for r in s["requests"]]
        assert all(len(p) == r["nodes"] for p, r in
                   zip(probs, (r for s in steps for r in s["requests"]))), name
        assert all(0.0 <= x <= 1.0 for p in probs for x in p), name
        assert name == "oracle" or any(x > 0.0 for p in probs for x in p)
