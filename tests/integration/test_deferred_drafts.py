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
