"""Structured output gets trees under its grammar, and greedy answers stay plain vLLM's.

One batch mixes what applications send: two JSON-schema requests, a regex and a
choice request, and an unconstrained one. The tree engine walks each grammar down
each tree in the scheduler (``vllm_glue.grammar_trees``), after the drafter
drafted under it (``vllm_glue.draft_grammars``): drafts the grammar rejects are cut, the tokens it forces are grafted as branches, and every node's
logits row is masked with its own grammar state. The drafter is the random test
drafter, so what the trees accept beyond chance comes from forced tokens and copy
branches. The T > 0 test with a grammar, and its negative control (masks shifted
by one node), live with the other homogeneity tests (``test_sampling``).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine, run_engine
from tests.integration.prompts import chat_token_ids

pytestmark = pytest.mark.vllm

MAX_TOKENS = 48
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Tokyo", "Lima"]},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
PROMPTS = [
    "Describe a person who lives in a big city as a JSON record.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Give me a short recipe for pancakes.",
    "Why do cats purr?",
    "What is the capital of Australia, and why is it not Sydney?",
]
CONSTRAINTS = [
    {"structured_outputs": {"json": PERSON}},
    {"structured_outputs": {"json": PERSON}},
    {"structured_outputs": {"regex": r"(Mix|Stir|Bake) (the|a) [a-z]+( [a-z]+){2,6}\."}},
    {"structured_outputs": {"choice": ["because they are happy", "to heal themselves",
                                       "nobody knows for sure"]}},
    {},
]
TREE = {"method": "eagle3_tree", "num_nodes": 16, "depth": 4, "top_k": 4, "adaptive": False}


def spec(target_dir, tokenizer, **engine):
    return {"engine": base_engine(target_dir, max_num_seqs=len(PROMPTS), **engine),
            "prompts": chat_token_ids(tokenizer, PROMPTS),
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            "sampling_per_prompt": CONSTRAINTS}


def test_structured_requests_get_trees_and_plain_answers(target_dir, tokenizer,
                                                         random_drafter, engine_dir):
    plain = run_engine(spec(target_dir, tokenizer), engine_dir, "structured_plain")
    tree = run_engine(spec(target_dir, tokenizer,
                           speculative_config=dict(TREE, model=str(random_drafter))),
                      engine_dir, "structured_tree")
    bad = [i for i, (a, b) in enumerate(zip(plain["outputs"], tree["outputs"])) if a != b]
    assert not bad, f"prompts {bad} differ from plain vLLM's answers"
    metrics = tree["tree"]
    # Trees were verified beside the grammar, and it forced tokens that were accepted.
    assert metrics["trees"] > 0 and metrics["mean_tree_size"] > 1, metrics
    assert metrics["grammar_accepted"] > 0, metrics
    # The structured requests were drafted under their grammars (draft_grammars).
    assert metrics["grammar_drafted"] > 0, metrics
    choice = tokenizer.decode(tree["outputs"][3][0], skip_special_tokens=True)
    assert choice in CONSTRAINTS[3]["structured_outputs"]["choice"], choice
