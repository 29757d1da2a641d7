"""Greedy eagle3_tree on architecture twins is token-identical to plain vLLM.

Each twin (``twins.py``) is a tiny random checkpoint of one published model family
(Llama 3, Qwen3, Qwen2.5, Qwen3-MoE, Mistral), served by vLLM's own model class for
it: the tree path must verify trees right on every architecture it serves, not
only on the SmolLM2 Llama of the other tests (q/k norms, qkv biases, tied or
untied heads, llama3 RoPE scaling, explicit head_dim, MoE layers, GQA ratios).

Per twin, one plain engine and one tree engine (and for Qwen3 the same pair
again at tensor parallelism 2) with a random EAGLE-3 head (each twin's in
another of the layouts heads are published in: ``HEAD_LAYOUTS``) and the
default tree settings (32 nodes, depth 6, top-k 8, copy branches) but a fixed
budget: on a twin the head costs about as much as the target, so the adaptive
budget rightly turns speculation off after the first two steps (measured: 8
trees in 48 tokens x 4 prompts), and the point here is trees verified on every
step. A random head rarely guesses right, so for half of the prompts the oracle
(``oracle.py``) swaps the tree the drafter proposed (the drafter still runs) for
one of the same size that hides the plain run's continuation along a random
branch among decoys: those trees are accepted deeply and at random branches, so
the KV commit and the drafter's catch-up run on each architecture, next to
requests of the same batch whose own trees (the head's, and copy branches:
accepted where a twin's text loops, as the MoE twin's does) are mostly rejected.
A wrong verification changes the text (the oracle keeps proposing the
reference, it cannot hide one); tree rows given linear instead of depth
positions, for one, fail the Llama 3 and Qwen3 twins.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import base_engine, run_engine
from tests.integration.drafters import random_eagle3_drafter, speculators_eagle3_drafter
from tests.integration.prompts import chat_token_ids
from tests.integration.twins import AUX_LAYERS, TWINS, VOCAB, build_twin

pytestmark = pytest.mark.vllm

MAX_TOKENS = 48
NUM_PROMPTS = 4
# The default tree settings, less the adaptive budget (see above).
TREE = {"method": "eagle3_tree", "adaptive": False}


# Each twin's head in one of the layouts heads are published in (docs/models.md):
# the layouts cost no engine of their own that way.
HEAD_LAYOUTS = {"llama3": "bin", "qwen3": "speculators", "qwen2.5": "full-vocabulary",
                "qwen3-moe": "original", "mistral": "narrow"}


def twin_head(layout: str, twin, out_dir):
    """A random head for ``twin`` in ``layout``: "original" (safetensors, a 4096-token
    draft vocabulary mapped by d2t), "bin" (the same in pytorch_model.bin),
    "full-vocabulary" (no d2t), "narrow" (half the twin's width, with
    target_hidden_size), "speculators" (speculators' config and weight names)."""
    if layout == "speculators":
        return speculators_eagle3_drafter(twin, out_dir, aux_layers=AUX_LAYERS)
    width = json.loads((twin / "config.json").read_text())["hidden_size"]
    kwargs = {"original": {}, "bin": {"layout": "bin"}, "full-vocabulary": {"draft_vocab": VOCAB},
              "narrow": {"hidden_size": width // 2}}[layout]
    return random_eagle3_drafter(twin, out_dir, aux_layers=AUX_LAYERS, **kwargs)


@pytest.fixture(scope="module")
def twin_prompts(tokenizer) -> list[list[int]]:
    return chat_token_ids(tokenizer)[:NUM_PROMPTS]


@pytest.mark.parametrize("name, tp", [(name, 1) for name in TWINS] + [("qwen3", 2)])
def test_greedy_tree_equals_plain_decoding_on_twin(name, tp, target_dir, twin_prompts,
                                                    tmp_path_factory, engine_dir):
    """``tp`` 2: both engines with tensor parallelism, one core a rank (the Qwen3
    twin's 8 query and 2 KV heads split in two, as its head's)."""
    root = tmp_path_factory.mktemp(f"twin-{name}")
    twin = build_twin(name, root / "target", target_dir)
    head = twin_head(HEAD_LAYOUTS.get(name, "original") if tp == 1 else "original", twin,
                     root / "head")
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    label, env = f"twin_{name}_tp{tp}", ({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {})

    def engine(twin, **overrides) -> dict:
        return base_engine(twin, max_model_len=1024, max_num_seqs=NUM_PROMPTS,
                           tensor_parallel_size=tp, **overrides)

    plain = run_engine({"engine": engine(twin), "prompts": twin_prompts,
                        "sampling": sampling}, engine_dir, f"{label}_plain", extra_env=env)
    expected = [o[0] for o in plain["outputs"]]
    # Non-trivial text: full length, and not one token repeated (a random twin whose
    # layers do not matter would repeat its last prompt token, see twins.py).
    assert [len(o) for o in expected] == [MAX_TOKENS] * NUM_PROMPTS, expected
    assert len({t for o in expected for t in o}) > NUM_PROMPTS, expected

    # the oracle's trees for the even prompts, the head's own for the odd ones
    reference = {",".join(map(str, p)): o
                 for p, o in list(zip(twin_prompts, expected))[::2]}
    tree = run_engine({"engine": engine(twin, speculative_config=dict(TREE, model=str(head))),
                       "prompts": twin_prompts, "sampling": sampling,
                       "oracle": {"reference": reference, "seed": 0}},
                      engine_dir, f"{label}_tree", extra_env=env)
    bad = [(i, next((k for k, (a, b) in enumerate(zip(o[0], e)) if a != b), None))
           for i, (o, e) in enumerate(zip(tree["outputs"], expected)) if o[0] != e]
    assert not bad, f"{name}: prompts differ from plain decoding (prompt, first token): {bad}"
    metrics = tree["tree"]
    # Trees were verified on every step (a chain engine has no tree metrics; a
    # request takes at least MAX_TOKENS / 9 steps), some accepted 4 deep or more.
    assert metrics["trees"] >= NUM_PROMPTS * MAX_TOKENS // 9, metrics
    depth = metrics["per_depth_acceptance"]
    assert len(depth) >= 4 and depth[3] > 0, metrics


# T > 0 on a non-Llama twin: test_sampling's harness (its prompts, settings, trie
# oracle and thresholds) on the Qwen3 twin, with fewer draws, and its gross control.
# A random twin's next-token distributions are nearly flat over 49152 tokens (every
# draw unique: no test has power there, and the trie oracle never guesses), so its
# (untied) lm_head is scaled up until they are as peaked as a trained model's.
N_TWIN = 300
LOGIT_SCALE = 8.0


@pytest.fixture(scope="module")
def qwen3_samples(target_dir, tokenizer, tmp_path_factory, engine_dir):
    from tests.integration.test_sampling import PROMPTS, SETTINGS, draw, trie_oracle

    root = tmp_path_factory.mktemp("twin-qwen3-sampled")
    from safetensors.torch import load_file, save_file

    twin = build_twin("qwen3", root / "target", target_dir)
    weights = load_file(twin / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * LOGIT_SCALE
    save_file(weights, twin / "model.safetensors", metadata={"format": "pt"})
    head = random_eagle3_drafter(twin, root / "head", aux_layers=AUX_LAYERS)
    prompts = chat_token_ids(tokenizer, PROMPTS)
    plain, _ = draw(twin, prompts, SETTINGS, 2 * N_TWIN, engine_dir, "twin_qwen3_plain_t1",
                    seed=1)
    oracle = trie_oracle(prompts, plain, N_TWIN)
    spec = {"method": "eagle3_tree", "model": str(head), "num_nodes": 12, "depth": 3,
            "top_k": 4, "adaptive": False}
    return twin, prompts, plain, oracle, spec


def test_the_qwen3_twin_samples_what_plain_sampling_does(qwen3_samples, engine_dir):
    from tests.integration.test_sampling import SETTINGS, assert_same_distributions, draw

    twin, prompts, plain, oracle, spec = qwen3_samples
    tree, metrics = draw(twin, prompts, SETTINGS, N_TWIN, engine_dir, "twin_qwen3_tree_t1",
                         seed=3, speculative_config=spec, oracle=oracle)
    assert_same_distributions(plain, tree, metrics)


def test_the_harness_detects_a_biased_rule_on_the_qwen3_twin(qwen3_samples, engine_dir):
    from tests.integration.test_sampling import N_CONTROL, SETTINGS, draw
    from vllm_treespec.bench.homogeneity import homogeneity_pvalue

    twin, prompts, plain, oracle, spec = qwen3_samples
    biased, _ = draw(twin, prompts[:1], SETTINGS[:1], N_CONTROL, engine_dir,
                     "twin_qwen3_tree_biased", seed=4, speculative_config=spec,
                     oracle=oracle, break_stochastic=True)
    assert homogeneity_pvalue(plain[0], biased[0]) < 1e-6
