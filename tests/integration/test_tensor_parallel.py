"""Tensor parallelism: eagle3_tree under ``--tensor-parallel-size 2`` on the CPU.

One core a rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), the SmolLM2 pair padded to
heads that 2 divides (``vllm-treespec assets --tp 2``: the same function). The
tree servers, adaptive with sequential drafting and fixed with parallel drafting
(the parallel-drafting head padded alike), answer chat, JSON-schema and completion
requests, sent concurrently, with the TP = 2 plain server's greedy text and real acceptance;
every server stopped with SIGTERM (busy or idle) leaves no process behind. An
engine whose rank 1 times everything three times slow (as on a busy core) still
plans the same depths on both ranks, step by step (``rank_agreement``). At
T > 0 the TP = 2 tree engine samples what the TP = 2 plain engine samples
(``test_sampling``'s harness, fewer draws), and a biased acceptance rule fails
the same test there.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import threading
import time

import openai
import psutil
import pytest

from tests.integration.conftest import (
    SMALL_M_LINEAR_ENV,
    base_engine,
    pinned_kernels,
    run_engine,
)
from tests.integration.prompts import CHAT_PROMPTS, chat_token_ids
from tests.integration.test_sampling import (
    PROMPTS as SAMPLED_PROMPTS,
    SETTINGS,
    TREE,
    assert_same_distributions,
    draw,
    trie_oracle,
)
from vllm_treespec.bench.homogeneity import homogeneity_pvalue
from vllm_treespec.bench.server import Server, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SERVE_ARGS = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "1024",
              "--seed", "0", "--max-num-seqs", "8", "--compilation-config", '{"mode": 0}']
# 10 in the suite (CI time); TREESPEC_TP_QUESTIONS=30 asks the 25 chat prompts and
# 5 more (the recorded must-show run, benchmarks/RESULTS.md).
ALL_QUESTIONS = CHAT_PROMPTS + ["Name three fruits.", "What is the capital of France?",
                               "Count to five.", "Say hello in Spanish.",
                               "Name a programming language."]
QUESTIONS = ALL_QUESTIONS[:int(os.environ.get("TREESPEC_TP_QUESTIONS", "10"))]
MAX_TOKENS = 48
# The fixed tree is grown by parallel drafting (the padded parallel-drafting head):
# the adaptive server covers sequential drafting.
FIXED = {"num_nodes": 12, "depth": 4, "top_k": 4, "adaptive": False, "draft": "parallel"}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                          "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# The CPU runner's linear-kernel choice, as each rank logs it.
KERNEL_CHOICE = re.compile(r"\(Worker_TP(?P<rank>\d+) pid=\d+\).*eagle3_tree: "
                           r"(?P<choice>linear layers keep oneDNN's kernels|\d+ linear layers "
                           r"use W @ x\^T for .+?-row inputs)")


@pytest.fixture(scope="module")
def tp_assets():
    """(target, drafter, parallel-drafting head), padded for TP = 2."""
    from vllm_treespec.assets import DRAFTER_NAME, PARALLEL_DRAFTER_NAME, ensure_tp_pair

    return ensure_tp_pair(multiple=2, drafter_names=(DRAFTER_NAME, PARALLEL_DRAFTER_NAME))


@pytest.fixture(scope="module")
def tp_pair(tp_assets):
    return tp_assets[:2]


@pytest.fixture(scope="module")
def tp_parallel_drafter(tp_assets):
    return tp_assets[2]


def start(model, log, spec=None, probe_kernels: bool = False) -> Server:
    """A TP = 2 server; ``probe_kernels``: the CPU runner times its linear-kernel
    choice at startup on every rank (the tests pin it otherwise)."""
    kernels = {SMALL_M_LINEAR_ENV: "1"} if probe_kernels else pinned_kernels()
    server = Server(str(model), SERVE_ARGS, spec, log, served_name="smollm2",
                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                         **TP_ENV, **kernels},
                    startup_timeout_s=600)
    server.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
    return server


def answers(client) -> dict:
    """Greedy answers, the chat requests four at a time."""
    def chat(q):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS, temperature=0.0).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out = {"chat": list(pool.map(chat, QUESTIONS))}
    # A structured request: trees under its grammar, drafted under it on both
    # ranks (``draft_grammars``: masked on every rank or on none).
    out["json"] = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=MAX_TOKENS, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON}}).choices[0].message.content
    out["completion"] = client.completions.create(
        model="smollm2", prompt="The three primary colours are", max_tokens=MAX_TOKENS,
        temperature=0.0).choices[0].text
    return out


def assert_all_gone(family: list[int], timeout_s: float = 60) -> None:
    """Every process of ``family`` exits (or is a zombie) within ``timeout_s``."""
    deadline = time.time() + timeout_s
    alive = family
    while alive and time.time() < deadline:
        alive = [pid for pid in family if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        time.sleep(1)
    assert not alive, f"processes left after SIGTERM: {alive}"


def stop_and_assert_nothing_left(server: Server, busy: bool) -> None:
    """SIGTERM the server (with a long request streaming if ``busy``); every
    process it started must be gone within 60 s."""
    family = [server.proc.pid] + [p.pid for p in psutil.Process(server.proc.pid)
                                  .children(recursive=True)]
    assert len(family) >= 3, family  # API server, engine core, two TP workers
    streaming = None
    if busy:
        def stream():
            try:
                for _ in server.client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                        max_tokens=900, temperature=0.0, stream=True):
                    pass
            except Exception:  # noqa: BLE001 -- the server goes away mid-stream
                pass
        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        time.sleep(3)
    server.close()
    assert_all_gone(family)
    if streaming is not None:
        streaming.join(30)


@pytest.fixture(scope="module")
def reference(tp_pair, tmp_path_factory):
    target, _ = tp_pair
    plain = start(target, tmp_path_factory.mktemp("tp") / "plain.log")
    try:
        out = answers(plain.client)
    finally:
        stop_and_assert_nothing_left(plain, busy=False)
    return out


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-parallel"])
def test_tp2_tree_server_answers_as_the_tp2_plain_server(adaptive, tp_pair, tp_parallel_drafter,
                                                         reference, tmp_path):
    target, drafter = tp_pair
    spec = ({"method": "eagle3_tree", "model": str(drafter)} if adaptive else
            {"method": "eagle3_tree", "model": str(tp_parallel_drafter), **FIXED})
    # The adaptive server also times the linear-kernel choice on both ranks at
    # startup (the choice that, made per rank, once hung a TP = 2 server).
    log = tmp_path / "tree.log"
    server = start(target, log, spec, probe_kernels=adaptive)
    try:
        got = answers(server.client)
        m = server.metrics()
    finally:
        stop_and_assert_nothing_left(server, busy=adaptive)
    assert got == reference
    # Timing-dependent for the adaptive server, and holds on any supported CPU:
    # a fresh budget prices depth 1 at 1.5 tokens a request (its acceptance
    # prior) and drafts while verifying 2 tokens a request costs under ~1.45x
    # one; in a 135M model's forward it costs about 1.1-1.3x (the 44 startup
    # sweeps logged under benchmarks/results time 16 tokens at 1.2-1.9x 4).
    # Otherwise its probes would draft every 32-256 steps.
    assert metric_sum(m, "vllm_treespec:trees_total") > 0, m
    # Real acceptance, not a budget that turned speculation off (the adaptive
    # budget drafts short chains here: a TP = 2 verify on two cores is dear).
    accepted = metric_sum(m, "vllm_treespec:mean_acceptance_length")
    assert accepted >= (1.2 if adaptive else 1.8), m
    if adaptive:
        choices = {}
        for line in log.read_text().splitlines():
            if match := KERNEL_CHOICE.search(line):
                choices.setdefault(match["rank"], []).append(match["choice"])
        assert set(choices) == {"0", "1"} and choices["0"] == choices["1"], choices


def test_a_slow_rank_plans_the_same_depths(tp_pair, tokenizer, engine_dir):
    """Rank 1 times every step three times slower than rank 0: with per-rank
    timings their budgets would plan different depths (and hang in a collective).
    (Greedy identity at TP = 2 is the server tests' subject; CI time.)"""
    target, drafter = tp_pair
    prompts = chat_token_ids(tokenizer)[:4]
    engine = base_engine(target, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=4,
                         speculative_config={"method": "eagle3_tree", "model": str(drafter)})
    out = run_engine({"engine": engine, "prompts": prompts, "slow_rank": {"rank": 1,
                                                                          "factor": 3.0},
                      "sampling": {"temperature": 0.0, "max_tokens": 96}},
                     engine_dir, "tp2_slow_rank", extra_env=TP_ENV)
    rank0, rank1 = out["planned_depths"]
    assert rank0 == rank1 and len(rank0) > 20
    # Holds on any supported CPU: see test_tp2_tree_server_answers_as_the_tp2_plain_server.
    assert max(rank0) > 0, "the budget never drafted"


# T > 0 at TP = 2: two of test_sampling's prompts and settings (plain T = 1, and
# nucleus), fewer draws (one core a rank), the same tests and thresholds. What TP
# can break here (ranks that accept different paths) is a gross error, and the
# control shows these tests catch one at this many draws.
N_TP = N_TP_CONTROL = 150
TP2 = {"tensor_parallel_size": 2, "max_model_len": 1024}


def test_tp2_tree_samples_match_tp2_plain_sampling(tp_pair, tokenizer, engine_dir):
    """The trie oracle drafts on every rank from the same plain sample, so the
    ranks agree on each tree. Each rank accepts and commits its own KV: a rank
    that accepted another path would attend to a wrong cache from then on, which
    these tests would see. A greedy acceptance rule at T > 0 must fail them."""
    target, drafter = tp_pair
    prompts = chat_token_ids(tokenizer, SAMPLED_PROMPTS[:2])
    settings = SETTINGS[:2]
    plain, _ = draw(target, prompts, settings, 2 * N_TP, engine_dir, "tp2_plain_sampled",
                    seed=1, engine=TP2, env=TP_ENV)
    oracle = trie_oracle(prompts, plain, N_TP)
    spec = dict(TREE, model=str(drafter))
    tree, metrics = draw(target, prompts, settings, N_TP, engine_dir, "tp2_tree_sampled",
                         seed=3, engine=TP2, env=TP_ENV, speculative_config=spec,
                         oracle=oracle)
    assert_same_distributions(plain, tree, metrics, settings)
    biased, _ = draw(target, prompts[:1], settings[:1], N_TP_CONTROL, engine_dir,
                     "tp2_tree_biased", seed=4, engine=TP2, env=TP_ENV,
                     speculative_config=spec, oracle=oracle, break_stochastic=True)
    assert homogeneity_pvalue(plain[0], biased[0]) < 1e-6
