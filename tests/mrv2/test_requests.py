"""Which requests eagle3_tree on MRV2 refuses at the frontend (``mrv2.requests``), read
from ``SamplingParams`` alone: no engine, so this runs in the ordinary unit lane too.
The engine-side proof (each refused with a 400 naming it, the engine alive after) is
``test_tree_sampling.py::test_refused_parameters_are_named_and_the_engine_lives``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from vllm_treespec.vllm_glue.mrv2.requests import CHECKS, mrv2_refusal  # noqa: E402

# One request per refused parameter (the test lane's engine test sends the same).
REFUSED = {
    "repetition_penalty": {"repetition_penalty": 1.3},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "logit_bias": {"logit_bias": {100: 5.0}},
    "allowed_token_ids": {"allowed_token_ids": [100, 200, 300]},
    "bad_words": {"bad_words": ["the"]},
    "min_tokens": {"min_tokens": 4},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "logprobs": {"logprobs": 2},
    "logprob_token_ids": {"logprob_token_ids": [100]},
}
# Served with trees: greedy, sampled, seeded, nucleus, min-p at temperature 0.
SERVED = [{}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}, {"temperature": 1.0, "seed": 7},
          {"temperature": 0.0, "min_p": 0.2}]


def sampling(**kwargs) -> SamplingParams:
    if "structured_outputs" in kwargs:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_parameter_is_named(name):
    try:
        params = sampling(**REFUSED[name])
    except TypeError:
        pytest.skip(f"this vLLM's SamplingParams has no {name!r}")
    refused = mrv2_refusal(params)
    assert refused is not None and refused[0] == name
    assert f"'{name}'" in refused[2] and "Model Runner V2" in refused[2]


@pytest.mark.parametrize("kwargs", SERVED)
def test_served_parameters_are_not_refused(kwargs):
    assert mrv2_refusal(sampling(**kwargs)) is None


def test_every_check_has_a_request():
    assert set(CHECKS) == set(REFUSED) | {"logits_processors"}  # not a 0.32.0 field
