"""Temperature > 0: eagle3_tree samples from the target model's distribution.

For each prompt, 4-token continuations are drawn many times (i.i.d.) from plain
vLLM and from eagle3_tree, and two chi-squared homogeneity tests compare them:
the distributions of whole sequences, and the next-token distributions after
every frequent prefix (where a tree's siblings compete). The tree drafter is an
oracle built from a plain-vLLM sample (the most frequent observed continuations,
several branches per node), so trees are accepted at several depths, as with a
good drafter. Trees grown by parallel drafting (``"draft": "parallel"``, one
distribution per depth) pass the same tests with an oracle that gives those
per-depth marginals (``parallel_oracle``). Two negative controls run the harness
against engines with biased acceptance rules and must fail it: a gross one (greedy
acceptance at T > 0) and a subtle one (later siblings accepted without
renormalisation). The fourth prompt samples under a grammar (structured output):
its trees are cut and grafted by the grammar, each node under its own mask; a
third control shifts those masks by one node and must fail.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import base_engine, run_engine, small_block_size
from tests.integration.prompts import chat_token_ids
from vllm_treespec.bench.homogeneity import homogeneity_pvalue, next_token_homogeneity_pvalue

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Name one fruit.",
    "Pick a colour and say why you like it.",
    "Say a random animal.",
    "Answer yes or no, then name an animal and its colour.",
]
# A grammar that forces text between its choices (", the ", " is "); no answer
# ends within LENGTH tokens, so every draw is LENGTH tokens long.
ANIMAL = r"(Yes|No), the (cat|dog|owl|fox) is (red|blue|green|gray)\."
# One sampling setting per prompt: plain, nucleus, penalties + top-k, a grammar
# (structured output: trees under it, vllm_glue.grammar_trees).
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.9, "top_k": 40, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 1.0, "structured_outputs": {"regex": ANIMAL}},
]
# Samples per prompt per engine. A tree engine's verify steps at 128 requests are
# compute-bound (each request verifies its whole tree), so N prices the suite: the
# controls below show the tests still fail a biased rule at no more draws than this.
# scripts/test.sh draws fewer on the other end of the vLLM range (it says why).
N = int(os.environ.get("TREESPEC_SAMPLING_N") or 600)
N_CONTROL = 200  # the greedy rule is far off; fewer samples suffice
# The grammar prompt's outcomes are few (32 answers, a handful of token splits each),
# and structured requests cost plain vLLM grammar work: half the draws (CI time).
DRAWS = [N, N, N, N // 2]
# Parallel drafting shares the acceptance rule with the test above; what differs is
# how its trees are grown, and a wrong tree there is a gross error, which the gross
# control shows these tests catch at N_CONTROL draws. The reference sample is still 2N.
N_PARALLEL = N_CONTROL
N_SUBTLE = 600   # the unnormalised-siblings control (p = 3e-12 once against 1,600 reference
                 # draws, when N was 800; the reference is 2N draws)
ALPHA = 1e-3     # a p-value below this fails the test
LENGTH = 4       # tokens per sample
TREE = {"method": "eagle3_tree", "num_nodes": 12, "depth": 3, "top_k": 4, "adaptive": False}
# Copies off: the subject is parallel drafting (the hybrid tests below verify
# copies at T > 0), and copies add to its time.
PARALLEL_TREE = dict(TREE, draft="parallel", copy_branches=0)


def draw(target_dir, prompts, settings, n, engine_dir, name, seed, engine=None, env=None,
         **extra):
    """n samples of every prompt (``n``: a count, or one per prompt), all in one
    engine (one batch stream); ``engine``: more engine settings, ``env``: more
    environment variables."""
    counts = [n] * len(prompts) if isinstance(n, int) else list(n)
    # Small blocks: the n copies of a prompt share its prefix-cached blocks (vLLM's CPU
    # default of 128 would leave these short prompts uncached and prefill dominating).
    spec = {"engine": base_engine(target_dir, max_num_seqs=128, seed=seed,
                                  block_size=small_block_size(), **(engine or {})),
            "prompts": [p for p, k in zip(prompts, counts) for _ in range(k)],
            "sampling": {"max_tokens": LENGTH, "ignore_eos": True},
            "sampling_per_prompt": [s for s, k in zip(settings, counts) for _ in range(k)]}
    if "speculative_config" in extra:
        spec["engine"]["speculative_config"] = extra.pop("speculative_config")
    spec.update(extra)
    out = run_engine(spec, engine_dir, name, extra_env=env)
    seqs = [tuple(o[0]) for o in out["outputs"]]
    starts = [sum(counts[:i]) for i in range(len(prompts) + 1)]
    return [seqs[a:b] for a, b in zip(starts, starts[1:])], out["tree"]


def assert_homogeneous(a: list[tuple], b: list[tuple], label) -> None:
    """Both homogeneity tests pass: draws ``b`` come from the distribution of ``a``."""
    p = homogeneity_pvalue(a, b)
    assert p > ALPHA, f"{label}: distributions of sequences differ (p={p:.2e})"
    p = next_token_homogeneity_pvalue(a, b, LENGTH)
    assert p > ALPHA, f"{label}: next-token distributions differ (p={p:.2e})"


def assert_same_distributions(plain, tree, metrics, settings=SETTINGS):
    """Both homogeneity tests pass for every setting, and the trees were really
    used: drafts accepted beyond the first depth."""
    for setting, a, b in zip(settings, plain, tree, strict=True):
        assert_homogeneous(a, b, setting)
    assert metrics["mean_accept_len"] > 1.5, metrics
    assert metrics["per_depth_acceptance"][1] > 0.05, metrics


def trie_oracle(prompts, plain, n: int) -> dict:
    """The trie oracle's spec, built from the first ``n`` plain draws of each prompt."""
    return {"mode": "trie", "reference": {",".join(map(str, p)): [list(t) for t in b[:n]]
                                          for p, b in zip(prompts, plain)}}


@pytest.fixture(scope="module")
def samples(target_dir, tokenizer, random_drafter, engine_dir):
    prompts = chat_token_ids(tokenizer, PROMPTS)
    # One plain engine, 2N draws a prompt (unseeded, i.i.d.): the first N build the
    # oracle's trie, and all 2N are the reference sample. The trie's half may serve:
    # a lossless tree emits target samples whatever trie drafted them, so its draws
    # are independent of that half under the hypothesis tested.
    plain, _ = draw(target_dir, prompts, SETTINGS, [2 * n for n in DRAWS], engine_dir,
                    "plain", seed=1)
    oracle = trie_oracle(prompts, plain, N)
    tree, metrics = draw(target_dir, prompts, SETTINGS, DRAWS, engine_dir, "tree", seed=3,
                         speculative_config=dict(TREE, model=str(random_drafter)),
                         oracle=oracle)
    return prompts, oracle, plain, tree, metrics


def test_tree_samples_match_plain_sampling(samples):
    _, _, plain, tree, metrics = samples
    assert_same_distributions(plain, tree, metrics)


def test_parallel_drafting_trees_sample_what_plain_sampling_does(samples, target_dir,
                                                                 engine_dir):
    """The same test for trees built from per-depth marginals (the shipped
    parallel-drafting head runs; its distributions come from the oracle)."""
    from vllm_treespec.assets import PARALLEL_DRAFTER_NAME, committed_drafter_dir

    prompts, oracle, plain, _, _ = samples
    tree, metrics = draw(target_dir, prompts, SETTINGS, N_PARALLEL, engine_dir, "parallel_tree",
                         seed=6,
                         speculative_config=dict(PARALLEL_TREE, model=str(
                             committed_drafter_dir(PARALLEL_DRAFTER_NAME))),
                         oracle=dict(oracle, mode="marginals"))
    assert_same_distributions(plain, tree, metrics)


def test_harness_detects_a_biased_acceptance_rule(samples, target_dir, random_drafter,
                                                  engine_dir):
    prompts, oracle, plain, _, _ = samples
    biased, _ = draw(target_dir, prompts[:1], SETTINGS[:1], N_CONTROL, engine_dir,
                     "tree_biased", seed=4,
                     speculative_config=dict(TREE, model=str(random_drafter)),
                     oracle=oracle, break_stochastic=True)
    assert homogeneity_pvalue(plain[0], biased[0]) < 1e-6


def test_harness_detects_unnormalised_siblings(samples, target_dir, random_drafter, engine_dir):
    """A bias only later siblings see: x_2 emitted with probability (1 - p(x_1)) p(x_2)
    instead of p(x_2). The next-token test must flag it. Prompt 1's frequent prefixes
    have several likely next tokens, where the mutant acts; on prompt 0, whose likely
    prefixes mostly have one dominant next token, 800 draws did not reveal it. The
    oracle keeps a drafter's top_k children a node: with every observed sibling (a
    dozen under the root) the lost mass spreads too thin for N_SUBTLE draws to show
    it (p = 1e-2 measured)."""
    prompts, oracle, plain, _, _ = samples
    biased, metrics = draw(target_dir, prompts[1:2], SETTINGS[1:2], N_SUBTLE, engine_dir,
                           "tree_unnormalised", seed=5,
                           speculative_config=dict(TREE, model=str(random_drafter)),
                           oracle=dict(oracle, max_children=TREE["top_k"]),
                           drop_sibling_renormalisation=True)
    assert metrics["per_depth_acceptance"][1] > 0.05, metrics  # trees were really used
    p = next_token_homogeneity_pvalue(plain[1], biased[0], LENGTH)
    assert p < ALPHA, f"the unnormalised-siblings rule passed the next-token test (p={p:.2e})"


def test_harness_detects_shifted_grammar_masks(samples, target_dir, random_drafter,
                                              engine_dir):
    """Negative control of trees under a grammar: every node's logits row masked
    with the next node's grammar state instead of its own fails the test."""
    prompts, oracle, plain, _, _ = samples
    shifted, metrics = draw(target_dir, prompts[3:], SETTINGS[3:], N_CONTROL, engine_dir,
                            "tree_shifted_masks", seed=10,
                            speculative_config=dict(TREE, model=str(random_drafter)),
                            oracle=oracle, shift_grammar_masks=True)
    assert metrics["trees"] > 0, metrics
    assert homogeneity_pvalue(plain[3], shifted[0]) < 1e-6


# Hybrid trees: a second turn that asks the model to repeat its first answer, so
# the copy source proposes that answer (from the request's own prompt, and from
# earlier draws' outputs) beside the shipped drafter's nodes, siblings from every
# source under one node.
HYBRID_CHAT = [{"role": "user", "content": "Name one fruit and say one thing about it."},
               {"role": "assistant", "content": "Mango. It is sweet and juicy."},
               {"role": "user", "content": "Say that again, word for word."}]
# Copies from other requests too: every draw before a request's is in the store.
HYBRID_TREE = dict(TREE, copy_branches=2, copy_length=3, cross_request_tokens=4096,
                   cross_request_unsalted=True)  # the draws carry no cache_salt
N_HYBRID = 500


@pytest.fixture(scope="module")
def hybrid_prompt(tokenizer):
    text = tokenizer.apply_chat_template(HYBRID_CHAT, add_generation_prompt=True, tokenize=False)
    return [tokenizer(text, add_special_tokens=False)["input_ids"]]


@pytest.fixture(scope="module")
def hybrid_plain(target_dir, hybrid_prompt, engine_dir):
    plain, _ = draw(target_dir, hybrid_prompt, SETTINGS[:1], N_HYBRID, engine_dir,
                    "hybrid_plain", seed=7)
    return plain


def test_hybrid_trees_sample_what_plain_sampling_does(target_dir, hybrid_prompt, hybrid_plain,
                                                      engine_dir):
    """Copy branches are point-mass proposals like the drafter's top-k children,
    so the same rule keeps them exact (docs/sampling.md): the tree's draws pass
    both homogeneity tests against plain vLLM's, and copies and drafts were both
    accepted."""
    from vllm_treespec.assets import committed_drafter_dir

    tree, metrics = draw(target_dir, hybrid_prompt, SETTINGS[:1], N_HYBRID, engine_dir,
                         "hybrid_tree", seed=8, speculative_config=dict(
                             HYBRID_TREE, model=str(committed_drafter_dir())))
    assert_homogeneous(hybrid_plain[0], tree[0], "hybrid tree")
    assert metrics["copy_accepted"] + metrics["both_accepted"] > 0, metrics
    assert metrics["other_accepted"] > 0, metrics
    assert metrics["mean_accept_len"] > 1.3, metrics


def test_harness_detects_a_biased_rule_on_hybrid_trees(target_dir, hybrid_prompt, hybrid_plain,
                                                       engine_dir):
    """Negative control: greedy acceptance at T > 0 on the same hybrid trees fails."""
    from vllm_treespec.assets import committed_drafter_dir

    biased, metrics = draw(target_dir, hybrid_prompt, SETTINGS[:1], N_CONTROL, engine_dir,
                           "hybrid_biased", seed=9, speculative_config=dict(
                               HYBRID_TREE, model=str(committed_drafter_dir())),
                           break_stochastic=True)
    assert metrics["copy_accepted"] + metrics["both_accepted"] > 0, metrics
    assert metrics["other_accepted"] > 0, metrics
    assert homogeneity_pvalue(hybrid_plain[0], biased[0]) < 1e-6
