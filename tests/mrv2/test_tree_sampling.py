"""``eagle3_tree`` on MRV2 beyond greedy, against plain MRV2 (Triton's interpreter):

* T > 0 is lossless: short continuations drawn many times (unseeded, i.i.d.) pass the
  V1 tests' two chi-squared homogeneity tests (whole sequences; next token after
  every frequent prefix) against plain MRV2's draws. Trees come from a trie oracle
  of plain draws (``oracle.py``), so they are accepted deep and across siblings. Two
  negative controls, the V1 tests' mutants of ``engine.accept.stochastic_accept``,
  must fail them: greedy acceptance at T > 0, and later siblings accepted without
  renormalisation.
* Seeded requests at T > 0 decode exactly what plain MRV2 decodes with their seed.
* 30 chat prompts (MT-Bench first turns), greedy, decode exactly as plain MRV2, with
  branching trees verified (the runner's counters), the log naming the V2 runner.
* Requests with parameters tree acceptance cannot reproduce are refused, each by
  name, and the engine serves the rest afterwards.

Sizes are the interpreter's: every MRV2 kernel launch runs in numpy. Run with
``bash scripts/test-mrv2.sh``; skipped otherwise (harness.GATE).
"""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import base_engine, small_block_size
from tests.integration.prompts import chat_token_ids
from tests.mrv2 import harness
from tests.mrv2.test_requests import REFUSED, SERVED
from tests.mrv2.test_tree_greedy import TREE, TREE_RUNNER
from vllm_treespec.bench.homogeneity import homogeneity_pvalue, next_token_homogeneity_pvalue

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not harness.enabled(),
                       reason="MRV2 under Triton's interpreter: bash scripts/test-mrv2.sh"),
    pytest.mark.skipif(not harness.has_mrv2(), reason="this vLLM has no MRV2 CPU runner"),
]

# Plain-text prompts whose first tree-decided token (the second: the first is the
# prefill's draw) is spread over a few likely tokens: there a tree's siblings compete,
# and the unnormalised-siblings mutant moves most mass. One setting each: plain
# temperature, and nucleus + top-k.
PROMPTS = ["Pick a number: 1, 2, 3 or 4. I pick number", "The four seasons are spring"]
SETTINGS = [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}]
N = int(os.environ.get("TREESPEC_MRV2_SAMPLING_N") or 100)  # tree draws a prompt
N_CONTROL = 600     # each control's draws (prompt 0 only; a tree engine draws cheaply)
LENGTH = 2          # tokens a draw
ALPHA = 1e-3        # a p-value below this fails a homogeneity test
MIN_CONTEXT = 20    # prefixes both samples reach this often get a next-token test
# Up to four siblings a node, as the V1 tests' top-4 trees: the unnormalised-siblings
# mutant shrinks every later sibling, so with two (TREE's top_k) it moved too little
# mass for these few draws to show (p = 0.16 at 100 draws against 160).
ORACLE_CHILDREN = 4
SEEDED = [{"temperature": 0.8, "seed": 11}, {"temperature": 1.0, "top_k": 50, "seed": 12},
          {"temperature": 0.7, "top_p": 0.8, "seed": 13}]
SEEDED_TOKENS = 12
NUM_CHAT = 30
CHAT_TOKENS = 8


def _engine(target_dir, tree: dict | None) -> dict:
    # Small blocks: a prompt's copies share its prefix-cached blocks.
    engine = base_engine(target_dir, max_num_seqs=128, block_size=small_block_size())
    if tree is not None:
        from vllm_treespec.assets import committed_drafter_dir

        engine["speculative_config"] = dict(tree, model=str(committed_drafter_dir()))
    return engine


def _sampled_batch(prompts, settings, n: int) -> dict:
    return {"name": "sampled", "prompts": [p for p in prompts for _ in range(n)],
            "sampling": {"max_tokens": LENGTH, "ignore_eos": True},
            "sampling_per_prompt": [s for s in settings for _ in range(n)]}


def _split(outputs, n: int, k: int) -> list[list[tuple]]:
    seqs = [tuple(o) for o in outputs]
    return [seqs[i * n:(i + 1) * n] for i in range(k)]


@pytest.fixture(scope="module")
def prompts(target_dir):
    from transformers import AutoTokenizer

    from vllm_treespec.bench.drafter_acceptance import mtbench_first_turns

    tok = AutoTokenizer.from_pretrained(target_dir)
    return {"sampled": [tok(p)["input_ids"] for p in PROMPTS],
            "chat": chat_token_ids(tok, mtbench_first_turns(NUM_CHAT))}


def _batches(prompts, n: int) -> list[dict]:
    chat, sampled = prompts["chat"], prompts["sampled"]
    return [
        {"name": "chat", "prompts": chat, "sampling": {"temperature": 0.0,
                                                       "max_tokens": CHAT_TOKENS}},
        {"name": "seeded", "prompts": chat[:len(SEEDED)], "sampling_per_prompt": SEEDED,
         "sampling": {"max_tokens": SEEDED_TOKENS, "ignore_eos": True}},
        _sampled_batch(sampled, SETTINGS, n),
    ]


@pytest.fixture(scope="module")
def plain(target_dir, prompts, tmp_path_factory) -> dict:
    """Plain MRV2: the chat and seeded batches, and 2N draws a sampled prompt (the
    first N build the oracle's trie, all 2N are the reference)."""
    spec = {"engine": _engine(target_dir, None), "batches": _batches(prompts, 2 * N)}
    out = harness.run_engine(spec, tmp_path_factory.mktemp("plain"), "plain", "v2",
                             module="tests.mrv2.tree_engine")
    out["draws"] = _split(out["sampled"]["outputs"], 2 * N, len(PROMPTS))
    return out


def _oracle(prompts, plain) -> dict:
    return {"reference": {",".join(map(str, p)): [list(t) for t in d[:N]]
                          for p, d in zip(prompts["sampled"], plain["draws"])},
            "max_children": ORACLE_CHILDREN}


@pytest.fixture(scope="module")
def tree(target_dir, prompts, plain, tmp_path_factory) -> dict:
    """The tree engine: the refused requests first, then the same batches."""
    workdir = tmp_path_factory.mktemp("tree")
    spec = {"engine": _engine(target_dir, TREE), "batches": _batches(prompts, N),
            "oracle": _oracle(prompts, plain),
            "refused": dict({k: v for k, v in REFUSED.items() if k != "structured_outputs"},
                            **{f"served-{i}": s for i, s in enumerate(SERVED)})}
    out = harness.run_engine(spec, workdir, "tree", "v2", module="tests.mrv2.tree_engine")
    out["log"] = (workdir / "tree.log").read_text()
    out["draws"] = _split(out["sampled"]["outputs"], N, len(PROMPTS))
    return out


def test_chat_prompts_greedy_equal_plain_mrv2_with_trees(plain, tree):
    assert (tree["runner"], tree["runner_mro"][2]) == (TREE_RUNNER, harness.V2_RUNNER)
    assert "Using V2 Model Runner" in tree["log"] and "eagle3_tree: Model Runner V2" in tree["log"]
    assert len(tree["chat"]["outputs"]) == NUM_CHAT
    assert tree["chat"]["outputs"] == plain["chat"]["outputs"]
    c = tree["chat"]["counters"]  # after the chat batch only
    assert c["verified_trees"] >= NUM_CHAT and c["branching_steps"] == c["verify_steps"] > 0, c
    assert c["accepted_tokens"] > 0, c
    print(f"\n{NUM_CHAT} chat prompts: tree {tree['chat']['seconds']:.1f} s, plain "
          f"{plain['chat']['seconds']:.1f} s, counters {c}")


def test_seeded_requests_decode_what_plain_mrv2_decodes(plain, tree):
    assert tree["seeded"]["outputs"] == plain["seeded"]["outputs"]
    before, after = tree["chat"]["counters"], tree["seeded"]["counters"]
    assert after["verified_trees"] > before["verified_trees"]


def assert_homogeneous(a, b, label) -> None:
    p = homogeneity_pvalue(a, b)
    assert p > ALPHA, f"{label}: distributions of sequences differ (p={p:.2e})"
    p = next_token_homogeneity_pvalue(a, b, LENGTH, MIN_CONTEXT)
    assert p > ALPHA, f"{label}: next-token distributions differ (p={p:.2e})"


def test_sampled_trees_match_plain_mrv2(plain, tree):
    for setting, a, b in zip(SETTINGS, plain["draws"], tree["draws"], strict=True):
        assert_homogeneous(a, b, setting)
    before, after = tree["seeded"]["counters"], tree["sampled"]["counters"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    trees = after["verified_trees"] - before["verified_trees"]
    # Trees were really used: drafts accepted (the bonus alone would be 0).
    assert after["oracle_trees"] > 0 and accepted >= 0.5 * trees, (before, after)


@pytest.mark.parametrize("control", ["break_stochastic", "drop_sibling_renormalisation"])
def test_biased_acceptance_fails_the_homogeneity_tests(target_dir, prompts, plain,
                                                       tmp_path, control):
    spec = {"engine": _engine(target_dir, TREE), control: True,
            "batches": [_sampled_batch(prompts["sampled"][:1], SETTINGS[:1], N_CONTROL)],
            "oracle": _oracle(prompts, plain)}
    out = harness.run_engine(spec, tmp_path, control, "v2", module="tests.mrv2.tree_engine")
    biased = [tuple(o) for o in out["sampled"]["outputs"]]
    p_seq = homogeneity_pvalue(plain["draws"][0], biased)
    p_next = next_token_homogeneity_pvalue(plain["draws"][0], biased, LENGTH, MIN_CONTEXT)
    print(f"\n{control}: p(sequences) {p_seq:.2e}, p(next token) {p_next:.2e}")
    assert min(p_seq, p_next) < ALPHA, (p_seq, p_next)


def test_refused_parameters_are_named_and_the_engine_lives(tree):
    report = tree["refusals"]
    for name in REFUSED:
        if name == "structured_outputs":
            continue  # needs StructuredOutputsParams: test_requests.py covers it
        # Ours names the parameter and MRV2; vLLM's own checks, where they refuse
        # first, name the parameter too.
        assert "error" in report[name], (name, report[name])
        assert name in report[name]["error"], (name, report[name])
        print(f"\n{name}: {report[name]['error'][:200]}")
    for i in range(len(SERVED)):
        assert report[f"served-{i}"]["served"], report[f"served-{i}"]
    assert len(tree["chat"]["outputs"]) == NUM_CHAT  # served after the refusals
