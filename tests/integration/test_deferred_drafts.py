"""While speculation is off the drafter does not run; its KV is caught up later.

A fixed schedule keeps speculation off for 4 of every 6 steps (the adaptive
budget's decision, made deterministic). With the shipped drafter, the first
draft token of every drafting step, keyed by request and root position, must
be what a drafter that ran every step proposes: the catch-up pass writes the KV
the skipped passes would have written. The negative control throws the
deferred inputs away instead; its drafts then differ often, which shows the
comparison can fail. Output is identical to plain decoding in every mode.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import SHORT_GREEDY_TOKENS as MAX_TOKENS
from tests.integration.conftest import base_engine, run_engine

pytestmark = pytest.mark.vllm

# Drafter-only trees: the test compares the drafter's drafts. The schedule installs
# its own budget, so the engine's own (and its startup calibration) would go unused.
TREE = {"method": "eagle3_tree", "num_nodes": 8, "depth": 3, "top_k": 4, "copy_branches": 0,
        "adaptive": False}


def run(target_dir, drafter, prompts, engine_dir, mode, chain):
    spec = {"engine": base_engine(target_dir,
                                  speculative_config=dict(TREE, model=str(drafter))),
            "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "schedule": {"off_steps": 4, "period": 6, "mode": mode, "chain": chain}}
    return run_engine(spec, engine_dir, f"deferred_{mode}_{'chain' if chain else 'tree'}")


def agreement(a: dict, b: dict) -> tuple[float, int]:
    common = set(a) & set(b)
    return sum(a[k] == b[k] for k in common) / max(len(common), 1), len(common)


# chain=True: every drafting step in chain mode, whose one-wide levels write the
# drafter's paged cache past the prefix (paged_drafts): catch-up must still
# leave the prefix exactly as a drafter that never skipped would.
@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_catch_up_restores_the_drafts_of_a_drafter_that_never_skipped(
        target_dir, short_greedy_reference, engine_dir, chain):
    from vllm_treespec.assets import committed_drafter_dir

    drafter = committed_drafter_dir()
    prompts, plain = short_greedy_reference
    outs = {m: run(target_dir, drafter, prompts, engine_dir, m, chain)
            for m in ("reference", "defer", "drop")}
    for mode, out in outs.items():
        assert out["outputs"] == plain["outputs"], f"{mode}: output differs from plain decoding"
    assert outs["reference"]["drafts"]["caught_up"] == 0
    assert outs["defer"]["drafts"]["caught_up"] > 100  # the off steps' tokens, batched
    ref = outs["reference"]["drafts"]["drafts"]
    same, n = agreement(ref, outs["defer"]["drafts"]["drafts"])
    dropped, m = agreement(ref, outs["drop"]["drafts"]["drafts"])
    assert n >= 50 and m >= 50, (n, m)
    assert same >= 0.97, f"caught-up drafts agree on {same:.1%} of {n} steps"
    assert dropped < same - 0.05, (
        f"negative control: without catch-up {dropped:.1%} of {m} drafts still agree "
        f"(with it {same:.1%}); the comparison cannot see a missing KV")


def test_requests_that_get_no_tree_cost_no_drafting(target_dir, short_greedy_reference,
                                                   engine_dir):
    """Requests ``tree_safe`` refuses (here: min_tokens still pending) are neither
    drafted for nor caught up (issue 94). Four at once: two that never get a tree
    (min_tokens = max_tokens), one that gets trees and finishes early (the control:
    its steps run the drafter), one whose min_tokens ends halfway. While no request
    of the batch may get a tree, a step runs no drafter forward and proposes nothing;
    beside tree requests, the first pass, the levels and the catch-up run for those
    alone. The
    halfway request catches up the inputs its plain steps deferred, then drafts.
    Output is plain decoding's throughout."""
    from vllm_treespec.assets import committed_drafter_dir

    prompts, plain = short_greedy_reference
    # Plain outputs without an end of sequence: min_tokens then changes nothing.
    full = [i for i, o in enumerate(plain["outputs"]) if len(o[0]) == MAX_TOKENS][:4]
    assert len(full) == 4, "the reference needs four outputs of full length"
    never, short, halfway = {"min_tokens": MAX_TOKENS}, {"max_tokens": 16}, \
        {"min_tokens": MAX_TOKENS // 2}
    per_prompt = [never, short, halfway, never]
    spec = {"engine": base_engine(target_dir, speculative_config=dict(
                TREE, model=str(committed_drafter_dir()))),
            "prompts": [prompts[i] for i in full], "sampling_per_prompt": per_prompt,
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "record_drafter_work": True}
    out = run_engine(spec, engine_dir, "no_tree_no_drafting")
    for i, got, sp in zip(full, out["outputs"], per_prompt):
        assert got[0] == plain["outputs"][i][0][:sp.get("max_tokens", MAX_TOKENS)], i

    steps = out["drafter_work"]
    none = [s for s in steps if not any(s["allowed"])]
    some = [s for s in steps if any(s["allowed"]) and not all(s["allowed"])]
    assert len(none) >= 8 and len(some) >= 8, (len(none), len(some))
    assert all(s["forwards"] == 0 and not any(s["drafts"]) for s in none), none
    for k, s in enumerate(some):
        tree_rows = [b for b, ok in enumerate(s["allowed"]) if ok]
        if k and not s["caught_up_rows"]:  # a decode step: no forward of plain rows
            # (vLLM's first pass would take every row and the rejected drafts')
            assert max(s["tokens"]) <= len(tree_rows) * (1 + TREE["num_nodes"]), s
        assert all(n == 0 for b, n in enumerate(s["drafts"]) if b not in tree_rows), s
        assert s["level_rows"] in (None, len(tree_rows)), s
        assert set(s["caught_up_rows"]) <= set(tree_rows), s
    # The control: steps with a tree request ran the drafter and proposed drafts,
    # and the halfway request caught up what its plain steps deferred.
    assert sum(s["forwards"] for s in some) > len(some), some
    assert sum(sum(s["drafts"]) for s in some) > 0
    assert any(s["caught_up_rows"] for s in some if len(s["allowed"]) == 3), some
