"""A request near ``max_model_len`` in the batch: vLLM (0.27.1, 0.32.0) then skips drafting
for the whole batch and hands the scheduler token-0 drafts, ``num_spec_tokens``
per request (``num_nodes``: 32 by default), which every request verifies and
rejects; under load that filled the KV cache (the soak: 5.9 tok/s against plain
vLLM's 100+). With ``eagle3_tree`` those steps schedule no drafts. Greedy output
stays that of plain decoding either way (verification is lossless), so the test
reads what was verified: with vLLM's handling (the negative control) chains of
``num_nodes`` junk tokens, deeper than any drafted tree can be."""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine, run_engine
from tests.integration.prompts import chat_token_ids

pytestmark = pytest.mark.vllm

MAX_LEN = 320
DEPTH = 4


def run(target_dir, prompts, engine_dir, name, spec_config=None, **extra):
    # The long request finishes first; the short ones then draft on their own.
    spec = {"engine": base_engine(target_dir, max_model_len=MAX_LEN,
                                  speculative_config=spec_config),
            "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": 64},
            "max_tokens_per_prompt": [8, 64, 64, 64], **extra}
    return run_engine(spec, engine_dir, name)


def test_a_request_near_max_model_len_costs_the_batch_no_junk_drafts(target_dir, tokenizer,
                                                                     engine_dir):
    from vllm_treespec.assets import committed_drafter_dir

    short = chat_token_ids(tokenizer)[:3]
    # Within num_nodes of max_model_len from its first step on.
    long = (sum(chat_token_ids(tokenizer), []) * 4)[: MAX_LEN - 12]
    prompts = [long] + short
    # A fixed tree drafts every step it can (the adaptive budget may rest at batch 3);
    # no copy branches, which reach past DEPTH (the test reads the verified depth).
    tree = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "depth": DEPTH,
            "num_nodes": 16, "top_k": 4, "adaptive": False, "copy_branches": 0}
    plain = run(target_dir, prompts, engine_dir, "near_max_plain")
    ours = run(target_dir, prompts, engine_dir, "near_max_tree", tree)
    control = run(target_dir, prompts, engine_dir, "near_max_control", tree,
                  vllm_zero_drafts=True)
    assert ours["outputs"] == plain["outputs"]
    assert control["outputs"] == plain["outputs"]  # junk drafts cost time, not text
    assert len(ours["tree"]["per_depth_acceptance"]) <= DEPTH, ours["tree"]
    assert ours["tree"]["mean_accept_len"] > 1.0, ours["tree"]
    # Negative control: vLLM's token-0 drafts are verified as 16-node chains.
    assert len(control["tree"]["per_depth_acceptance"]) > DEPTH, control["tree"]
