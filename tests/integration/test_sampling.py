"""Temperature > 0: eagle3_tree samples from the target model's distribution.

For each prompt, 4-token continuations are drawn many times (i.i.d.) from plain
vLLM and from eagle3_tree, and a chi-squared homogeneity test compares the two
distributions of whole sequences. The tree drafter is an oracle built from a
separate plain-vLLM sample (the most frequent observed continuations, several
branches per node), so trees are accepted at several depths, as with a good
drafter. A negative control runs the same harness against an engine with a
deliberately biased acceptance rule and must fail it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from scipy import stats

from tests.integration.conftest import base_engine, run_engine
from tests.integration.prompts import chat_token_ids

pytestmark = pytest.mark.vllm

PROMPTS = [
    "Name one fruit.",
    "Pick a colour and say why you like it.",
    "Say a random animal.",
]
# One sampling setting per prompt: plain, nucleus, penalties + top-k.
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.9, "top_k": 40, "repetition_penalty": 1.3, "presence_penalty": 0.5},
]
N = 800          # samples per prompt per engine
N_CONTROL = 200  # the biased rule is far off; fewer samples suffice
LENGTH = 4       # tokens per sample
TREE = {"method": "eagle3_tree", "num_nodes": 12, "depth": 3, "top_k": 4, "adaptive": False}


def draw(target_dir, prompts, settings, n, engine_dir, name, seed, **extra):
    """n samples of every prompt, all in one engine (one batch stream)."""
    # 16-token blocks: the n copies of a prompt share its prefix-cached blocks (vLLM's CPU
    # default of 128 would leave these short prompts uncached and prefill dominating).
    spec = {"engine": base_engine(target_dir, max_num_seqs=128, seed=seed, block_size=16),
            "prompts": [p for p in prompts for _ in range(n)],
            "sampling": {"max_tokens": LENGTH, "ignore_eos": True},
            "sampling_per_prompt": [s for s in settings for _ in range(n)]}
    if "speculative_config" in extra:
        spec["engine"]["speculative_config"] = extra.pop("speculative_config")
    spec.update(extra)
    out = run_engine(spec, engine_dir, name)
    seqs = [tuple(o[0]) for o in out["outputs"]]
    return [seqs[i * n:(i + 1) * n] for i in range(len(prompts))], out["tree"]


def homogeneity_pvalue(a: list[tuple], b: list[tuple]) -> float:
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    common = [k for k in keys if ca[k] + cb[k] >= 10]
    rest = [k for k in keys if ca[k] + cb[k] < 10]
    table = [[ca[k] for k in common], [cb[k] for k in common]]
    if rest:
        table[0].append(sum(ca[k] for k in rest))
        table[1].append(sum(cb[k] for k in rest))
    return stats.chi2_contingency(table).pvalue


@pytest.fixture(scope="module")
def samples(target_dir, tokenizer, random_drafter, engine_dir):
    prompts = chat_token_ids(tokenizer, PROMPTS)
    # One plain engine, 2N draws a prompt (unseeded, i.i.d.): the first N build the
    # oracle's trie, the other N are the reference sample.
    both, _ = draw(target_dir, prompts, SETTINGS, 2 * N, engine_dir, "plain", seed=1)
    train, plain = [b[:N] for b in both], [b[N:] for b in both]
    oracle = {"mode": "trie", "reference": {",".join(map(str, p)): [list(t) for t in tr]
                                            for p, tr in zip(prompts, train)}}
    tree, metrics = draw(target_dir, prompts, SETTINGS, N, engine_dir, "tree", seed=3,
                         speculative_config=dict(TREE, model=str(random_drafter)),
                         oracle=oracle)
    return prompts, oracle, plain, tree, metrics


def test_tree_samples_match_plain_sampling(samples):
    _, _, plain, tree, metrics = samples
    for setting, a, b in zip(SETTINGS, plain, tree):
        p = homogeneity_pvalue(a, b)
        assert p > 1e-3, f"{setting}: distributions differ (p={p:.2e})"
    # The trees were really used: drafts accepted beyond the first depth.
    assert metrics["mean_accept_len"] > 1.5, metrics
    assert metrics["per_depth_acceptance"][1] > 0.05, metrics


def test_harness_detects_a_biased_acceptance_rule(samples, target_dir, random_drafter,
                                                  engine_dir):
    prompts, oracle, plain, _, _ = samples
    biased, _ = draw(target_dir, prompts[:1], SETTINGS[:1], N_CONTROL, engine_dir,
                     "tree_biased", seed=4,
                     speculative_config=dict(TREE, model=str(random_drafter)),
                     oracle=oracle, break_stochastic=True)
    assert homogeneity_pvalue(plain[0][:N_CONTROL], biased[0]) < 1e-6
