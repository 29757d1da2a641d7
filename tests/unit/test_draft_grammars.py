"""The drafter's own grammar matchers (``vllm_glue.draft_grammars``): compiled with
vLLM's real xgrammar backend and the compile call its scheduler makes, they follow
a request's output through the runner's token table and the step's sampled tail,
and give the drafting step the mask a fresh matcher gives after the same output.
A matcher that disagrees with the output stops masking its request; a table that
does not end at the root yet masks nothing. (The runner's batch is a stand-in
holding the arrays ``draft_grammars`` reads.)"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from vllm_treespec.engine.grammar import full_masks
from vllm_treespec.vllm_glue import versions
from vllm_treespec.vllm_glue.draft_grammars import DraftGrammars
from vllm_treespec.vllm_glue.sampled_tail import SampledTail

xgr = pytest.importorskip("xgrammar")

from tests.unit.test_grammar_tree import SCHEMA, g  # noqa: E402,F401

PROMPT = [1, 2, 3]


@pytest.fixture
def grammars(g):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = types.SimpleNamespace(
        structured_outputs_config=types.SimpleNamespace(disable_any_whitespace=False),
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama")),
        speculative_config=types.SimpleNamespace(num_speculative_tokens=16))
    out = DraftGrammars(config)
    out._backend = XgrammarBackend(config, tokenizer=g.tok, vocab_size=g.V)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    out.fresh = lambda: versions.compile_request_grammar(out._backend, params).matcher
    out.arrived("r", params)
    out.entries["r"].grammar.result(timeout=60)
    return out


def batch(output):
    tokens = PROMPT + list(output)
    return types.SimpleNamespace(req_ids=["r"], num_tokens_no_spec=np.array([len(tokens)]),
                                 num_prompt_tokens=np.array([len(PROMPT)]),
                                 token_ids_cpu=np.array([tokens + [0] * 8]))


def fresh_mask(grammars, g, output):
    """The oracle: a fresh matcher of the same compile, fed ``output``."""
    m = grammars.fresh()
    for t in output:
        assert m.accept_token(t)
    row = full_masks(1, g.V)
    m.fill_next_token_bitmask(row, 0)
    return row[0]


def root_mask(masks, g):
    row = full_masks(1, g.V)
    masks.matchers[0].fill_next_token_bitmask(row, 0)
    return row[0]


def test_the_matcher_follows_the_output_table_and_the_sampled_tail(grammars, g):
    out = g.answer
    masks = grammars.step_masks(batch(out[:3]), [0], [out[2]], g.V, None)
    assert torch.equal(root_mask(masks, g), fresh_mask(grammars, g, out[:3]))
    # The step's tokens, sampled but not yet written into the table (the
    # drafter runs before vLLM's bookkeeping).
    table = batch(out[:3])
    grammars.sampled(SampledTail(torch.tensor([[out[3], out[4], -1]]),
                                 table.num_tokens_no_spec))
    masks = grammars.step_masks(table, [0], [out[4]], g.V, None)
    assert torch.equal(root_mask(masks, g), fresh_mask(grammars, g, out[:5]))
    assert grammars.entries["r"].accepted == 5
    # Written since (the count grew): the tail is not read twice.
    masks = grammars.step_masks(batch(out[:6]), [0], [out[5]], g.V, None)
    assert torch.equal(root_mask(masks, g), fresh_mask(grammars, g, out[:6]))


def test_a_table_behind_its_root_masks_nothing_and_moves_nothing(grammars, g):
    out = g.answer
    assert grammars.step_masks(batch(out[:3]), [0], [out[3]], g.V, None) is None
    assert grammars.entries["r"].accepted == 0
    assert grammars.step_masks(batch(out[:4]), [0], [out[3]], g.V, None) is not None


def test_a_matcher_that_rejects_the_output_stops_masking(grammars, g, caplog):
    bad = [g.answer[0], g.stop, g.answer[1]]
    with caplog.at_level("WARNING", logger="vllm.treespec"):
        assert grammars.step_masks(batch(bad), [0], [bad[-1]], g.V, None) is None
    assert grammars.entries["r"].failed and "drafts without its grammar" in caplog.text
    good = batch(g.answer[:2])
    assert grammars.step_masks(good, [0], [g.answer[1]], g.V, None) is None
    grammars.forget(["r"])
    assert not grammars.active
