"""OpenAI-compatible HTTP through `vllm-treespec serve` with eagle3_tree.

Two servers on 127.0.0.1, same flags: plain vLLM (reference answers) and
eagle3_tree with the shipped drafter, a branching tree on every step and copy
branches (hybrid trees: continuations copied from the request's own history and
from finished requests of its tenant, verified beside the drafter's nodes).
Driven by the official `openai` client: chat and completions, streaming, n>1,
stop strings, logprobs, concurrent requests, a client that disconnects
mid-stream, and T > 0 samples whose distribution must be plain vLLM's.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import pinned_kernels
from vllm_treespec.bench.request_mix_run import SERVE_ARGS  # with a reasoning config
from vllm_treespec.bench.server import Server, metric_sum

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "Give three reasons to learn a second language.",
    "What is the boiling point of water at sea level?",
    "Write a short poem about the sea.",
    "Explain recursion to a beginner.",
    "List the planets of the solar system.",
    "How do I make a cup of tea?",
    "What is 17 times 23?",
    # Copy branches' answer: it copies the prompt, tokens a drafter cannot guess.
    "Repeat exactly, twice: 7 kiwi 93 lamp 41 zebra 18 cloud 62 piano 5 fjord 80 quill",
]
MAX_TOKENS = 64


def start(target: Path, log: Path, spec: dict | None) -> Server:
    """The benchmark's server (same launcher), with an OpenAI client attached."""
    server = Server(str(target), SERVE_ARGS, spec, log, served_name="smollm2",
                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                         **pinned_kernels()},
                    startup_timeout_s=600)
    server.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
    return server


def chat(client, question, **kw):
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **kw}
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], **kw)


def collect(client) -> dict:
    """Everything whose greedy answer must be identical across the two servers."""
    out = {"chat": [chat(client, q).choices[0].message.content for q in QUESTIONS]}
    comp = client.completions.create(model="smollm2", prompt="The three primary colours are",
                                     max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    out["completion"] = comp.choices[0].text
    out["logprobs"] = comp.choices[0].logprobs.token_logprobs
    out["top_logprobs"] = [sorted(d) for d in comp.choices[0].logprobs.top_logprobs]
    out["stop"] = chat(client, QUESTIONS[5], stop=["Mars", "\n\n"]).choices[0].message.content
    # Penalties on every node of a tree (tree.penalties), greedy: the argmax must see them.
    out["penalised"] = chat(client, QUESTIONS[5], frequency_penalty=0.8, presence_penalty=0.4,
                            extra_body={"repetition_penalty": 1.3}).choices[0].message.content
    return out


@pytest.fixture(scope="module")
def plain_server(target_dir, tmp_path_factory):
    """Plain vLLM, up for the whole module (the T > 0 test draws from it last)."""
    plain = start(target_dir, tmp_path_factory.mktemp("plain") / "plain.log", None)
    yield plain
    plain.close()


@pytest.fixture(scope="module")
def servers(plain_server, target_dir, tmp_path_factory):
    from vllm_treespec.assets import committed_drafter_dir

    logs = tmp_path_factory.mktemp("servers")
    reference = collect(plain_server.client)
    # The shipped drafter with the budget off: every step verifies a branching
    # tree and accepts real drafts, so logprobs, stop strings, streaming and n>1
    # go through multi-token tree steps (a random drafter accepts nothing, and
    # the adaptive budget would switch it off).
    spec = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "num_nodes": 12,
            "depth": 4, "top_k": 4, "adaptive": False, "copy_branches": 2, "copy_length": 6,
            "cross_request_tokens": 8192, "cross_request_unsalted": True}
    tree = start(target_dir, logs / "tree.log", spec)
    yield reference, tree
    tree.close()


def test_greedy_answers_equal_plain_vllm(servers):
    reference, tree = servers
    got = collect(tree.client)
    assert got["chat"] == reference["chat"]
    assert got["completion"] == reference["completion"]
    assert got["top_logprobs"] == reference["top_logprobs"]
    assert got["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-3)
    assert got["stop"] == reference["stop"]
    assert "Mars" not in got["stop"]
    assert got["penalised"] == reference["penalised"]
    assert reference["penalised"] != reference["chat"][5]  # the penalties changed the answer


def test_streaming_equals_non_streaming(servers):
    reference, tree = servers
    for q, expected in zip(QUESTIONS[:3], reference["chat"]):
        stream = chat(tree.client, q, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected


TOP_K = 5  # the n > 1 samples' top-k: every sampled token must rank within it


def target_rows(client, prompt: list[int], answer: list[int], k: int) -> list[dict]:
    """The target's own next-token log-probabilities at each token of ``answer``
    after ``prompt``: one prefill of prompt + answer with vLLM's prompt logprobs
    (a plain forward, no tree involved), as {token id: {"logprob", "rank"}} per
    answer token, holding its top ``k`` and the answer's token."""
    resp = client.completions.create(model="smollm2", prompt=prompt + answer, max_tokens=1,
                                     temperature=0.0, extra_body={"prompt_logprobs": k})
    rows = resp.choices[0].prompt_logprobs[len(prompt):]
    assert len(rows) == len(answer)
    return [{int(t): v for t, v in row.items()} for row in rows]


def sample_chat(client, question, n, seed, top_k):
    resp = chat(client, question, max_tokens=24, temperature=1.0, n=n, seed=seed,
                extra_body={"top_k": top_k, "return_token_ids": True})
    return resp.prompt_token_ids, [c.token_ids for c in resp.choices]


def test_n_greater_than_one_at_temperature(servers):
    """n seeded samples through tree steps. vLLM gives the i-th of n the seed
    seed + i (``parallel_sampling``), and a seeded request's text depends on its
    seed alone (docs/sampling.md), so each answer must be the one a request
    with that seed gets on its own; and each is a sample of the request's
    distribution: every token ranks within its top-k under the target (a plain
    prefill of prompt + answer recomputes the ranks). The same samples without
    top-k leave it (negative control: the rank check can fail)."""
    _, tree = servers
    prompt, answers = sample_chat(tree.client, QUESTIONS[3], n=4, seed=7, top_k=TOP_K)
    assert len(answers) == 4 and all(answers)
    assert len({tuple(a) for a in answers}) > 1
    alone = [sample_chat(tree.client, QUESTIONS[3], n=1, seed=7 + i, top_k=TOP_K)[1][0]
             for i in range(4)]
    assert answers == alone
    ranks = [[row[t]["rank"] for t, row in zip(a, target_rows(tree.client, prompt, a, 1))]
             for a in answers]
    assert max(map(max, ranks)) <= TOP_K, ranks
    _, free = sample_chat(tree.client, QUESTIONS[3], n=4, seed=7, top_k=0)  # 0: none
    free_ranks = [row[t]["rank"] for a in free
                  for t, row in zip(a, target_rows(tree.client, prompt, a, 1))]
    assert max(free_ranks) > TOP_K, free_ranks


def test_logprobs_of_sampled_tokens_are_the_targets(servers):
    """Logprobs at T > 0 through tree steps whose drafts are accepted: each
    returned token's logprob (vLLM's default raw logprobs: the target's
    log-softmax, before temperature) and its top-3 list are the target's own at that
    position, as a plain prefill of prompt + answer computes them. Sampled
    tokens below the argmax and a comparison one position off show that the
    check tells the rows of a tree's nodes apart."""
    _, tree = servers
    before = tree.metrics()
    # T 0.8: raw logprobs are those before temperature, a scaled row would differ.
    resp = chat(tree.client, QUESTIONS[4], max_tokens=48, temperature=0.8, seed=3,
                logprobs=True, top_logprobs=3,
                extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    accepted = metric_sum(tree.metrics(), "vllm:spec_decode_num_accepted_tokens_total") \
        - metric_sum(before, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0  # tree steps emitted drafts, each with its node's logprobs
    choice = resp.choices[0]
    answer, content = choice.token_ids, choice.logprobs.content
    assert [int(c.token.removeprefix("token_id:")) for c in content] == answer
    rows = target_rows(tree.client, resp.prompt_token_ids, answer, 5)
    got = [c.logprob for c in content]
    want = [row[t]["logprob"] for t, row in zip(answer, rows)]
    assert got == pytest.approx(want, abs=1e-3)
    # vLLM lists a position's first top_logprobs entries, the sampled token's
    # first: the sampled token, then the best others. Each listed logprob is the
    # prefill's, and so are the three values (two near-tied tokens may swap).
    for tok, c, row in zip(answer, content, rows):
        top = {int(x.token.removeprefix("token_id:")): x.logprob for x in c.top_logprobs}
        assert tok in top and all(t in row for t in top), (tok, top, row)
        assert list(top.values()) == pytest.approx([row[t]["logprob"] for t in top], abs=1e-3)
        others = sorted((t for t in row if t != tok), key=lambda t: row[t]["rank"])
        best = sorted((row[t]["logprob"] for t in [tok] + others[:2]), reverse=True)
        assert sorted(top.values(), reverse=True) == pytest.approx(best, abs=1e-3)
    assert any(row[t]["rank"] > 1 for t, row in zip(answer, rows))  # sampled, not greedy
    assert got[1:] != pytest.approx(want[:-1], abs=1e-3)  # one row off differs


def test_concurrent_requests(servers):
    reference, tree = servers
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: chat(tree.client, q).choices[0].message.content,
                                QUESTIONS))
    assert answers == reference["chat"]


def test_client_disconnect_mid_stream_leaves_server_healthy(servers):
    reference, tree = servers
    stream = chat(tree.client, QUESTIONS[4], stream=True, max_tokens=512)
    received = 0
    for chunk in stream:
        received += 1
        if received == 5:
            break
    stream.close()  # abort: the server must drop the request and keep serving
    time.sleep(1)
    assert chat(tree.client, QUESTIONS[0]).choices[0].message.content == reference["chat"][0]
    assert tree.proc.poll() is None


# Requests of this module that the frontend aborts while they run: the stop-string
# answer in ``collect`` and the stream the disconnect test drops.
ABORTED_REQUESTS = 2


def accepted_by_source(before: dict, after: dict, source: str) -> float:
    """Accepted draft tokens credited to ``source`` between two /metrics reads."""
    key = 'vllm_treespec:accepted_tokens_total{'
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k.startswith(key) and f'source="{source}"' in k)


def test_tree_metrics_on_prometheus_endpoint(servers):
    _, tree = servers
    chat(tree.client, QUESTIONS[-1])  # its answer in the store, whatever ran before
    before = tree.metrics()
    chat(tree.client, QUESTIONS[-1])
    m = tree.metrics()  # no wait: the counters came with the answer's last step

    def delta(name):
        return metric_sum(m, name) - metric_sum(before, name)

    def by_source(source):
        return accepted_by_source(before, m, source)

    # A repetitive answer: its copy branches were accepted, and every accepted
    # draft is counted under exactly one source.
    assert by_source("copy") > 0, m
    assert sum(map(by_source, ("drafter", "copy", "other_requests", "both"))) == delta(
        "vllm:spec_decode_num_accepted_tokens_total"), m
    # the question was asked just before: its answer is in the store
    assert delta("vllm_treespec:cross_request_hits_total") > 0, m
    assert metric_sum(m, "vllm_treespec:cross_request_cached_tokens") > 0, m

    # Over one request that the engine finishes itself (length or EOS), vLLM's
    # scheduler counts every tree the worker verified, as a draft (the budget is
    # off: every draft is a verified node), and each emitted token once, both
    # from the same steps' stats.
    trees = delta("vllm_treespec:trees_total")
    assert trees > 0, m
    assert trees == delta("vllm:spec_decode_num_drafts_total"), m
    assert delta("vllm_treespec:draft_nodes_total") == delta(
        "vllm:spec_decode_num_draft_tokens_total"), m
    assert delta("vllm_treespec:emitted_tokens_total") == trees + delta(
        "vllm:spec_decode_num_accepted_tokens_total"), m
    # Since startup, vLLM counts fewer only by the requests aborted during a step
    # (it drops their results; one step each at most): aborts are applied before
    # a step's results are taken, and never between them and the next schedule's.
    # With one API server, vLLM's logging stat logger ran on the same steps'
    # stats after the tree logger took its payload out.
    lost = metric_sum(m, "vllm_treespec:trees_total") - metric_sum(
        m, "vllm:spec_decode_num_drafts_total")
    assert 0 <= lost <= ABORTED_REQUESTS, m
    # Trees accepted drafts (test_greedy_answers_equal_plain_vllm and the rest
    # then checked multi-token steps, not just bonus tokens).
    assert metric_sum(m, "vllm_treespec:mean_acceptance_length") >= 1.3, m
    # every fallback the worker warns of names a series that exists
    from vllm_treespec.vllm_glue.metrics import FALLBACKS

    missing = [k for k in FALLBACKS if f"vllm_treespec:{k}_total" not in
               {name.partition("{")[0] for name in m}]
    assert not missing, missing
    assert any(k.startswith("vllm_treespec:stage_seconds_total{") and 'stage="verify_forward"' in k
               for k in m)
    # vLLM's logging stat logger really ran on those steps (it would fail on a
    # tree payload left in the stats), and so did the tree logger's summary. Both
    # log on vLLM's periodic tick (VLLM_LOG_STATS_INTERVAL, 10 s), which may not
    # have come since this server started when this test runs first.
    wanted = ("SpecDecoding metrics", "eagle3_tree: mean acceptance length")
    deadline = time.monotonic() + 30
    while missing := [w for w in wanted if w not in tree.log_path.read_text()]:
        assert time.monotonic() < deadline, missing
        time.sleep(0.5)


def test_copies_from_other_requests_stay_within_their_tenant(servers, plain_server):
    """vLLM's ``cache_salt`` is the tenant: alice's second identical request
    accepts copies of her first answer (greedy, identical to plain vLLM's), bob's
    accepts none, counted by source on /metrics. Were the store shared across
    tenants, bob's request would be alice's second (same text, same store): his
    count is the check that fails without isolation, hers shows it can count."""
    _, tree = servers
    question = "Count from one to twenty in words, separated by commas."  # asked only here

    def ask(salt):
        before = tree.metrics()
        text = chat(tree.client, question,
                    extra_body={"cache_salt": salt}).choices[0].message.content
        return text, accepted_by_source(before, tree.metrics(), "other_requests")

    first, _ = ask("alice")
    bob, leaked = ask("bob")
    again, copied = ask("alice")
    assert leaked == 0 and copied > 0, (leaked, copied)
    assert first == bob == again == chat(plain_server.client, question).choices[0].message.content


def test_worker_returns_free_heap_when_the_engine_idles(servers):
    """The tree worker trims its heap when its last request finishes (host_heap):
    the first idle moment always trims, and the worker logs it."""
    _, tree = servers
    chat(tree.client, QUESTIONS[2])
    # The engine's next step tells the worker the request finished: polled (a
    # fixed second was a race on a busy 2-core machine), with a deadline that
    # only a hung engine misses.
    deadline = time.monotonic() + 60
    while "eagle3_tree: engine idle, returned" not in tree.log_path.read_text():
        assert time.monotonic() < deadline, "no idle trim logged"
        time.sleep(0.2)


def test_vllm_bench_serve_runs_against_the_tree_server(servers, target_dir, tmp_path):
    """vLLM's own serving benchmark, as users measure with it (``vllm bench serve``
    through ``vllm-treespec vllm``): every request completes against the tree server."""
    import json
    import subprocess
    import sys

    _, tree = servers
    cmd = [sys.executable, "-m", "vllm_treespec", "vllm", "bench", "serve",
           "--base-url", tree.base_url, "--model", str(target_dir),
           "--served-model-name", "smollm2", "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", "16", "--num-prompts", "4",
           "--seed", "0", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", "bench.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4, result
    assert result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] > 0, result


# Tree draws; plain vLLM draws twice as many (test_sampling's design). The rule's
# power is test_sampling's subject; what serving could add (requests' sampling
# settings lost or changed on their way to the engine) is a gross error, which
# test_sampling's gross control shows these tests catch at 200 draws.
N_SERVED = 200


def served_draws(client, n: int) -> list[tuple]:
    """n i.i.d. 4-token answers (unseeded, T = 1) to test_sampling's hybrid chat,
    eight a request (vLLM's n: one batch of the server's eight slots)."""
    from tests.integration.test_sampling import HYBRID_CHAT, LENGTH

    draws: list[tuple] = []
    while len(draws) < n:
        resp = client.chat.completions.create(
            model="smollm2", messages=HYBRID_CHAT, max_tokens=LENGTH, temperature=1.0, n=8,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        draws += [tuple(c.token_ids) for c in resp.choices]
    return draws[:n]


def test_hybrid_trees_sample_what_plain_vllm_samples_over_http(servers, plain_server):
    """test_sampling's hybrid distribution test through the served path: the
    second turn asks for the first answer again, so copies and the drafter's nodes
    are siblings; the tree server's draws pass both homogeneity tests against the
    plain server's, and copies were accepted. (The harness's negative controls run
    in-process, where a biased rule can be installed: test_sampling.)"""
    from tests.integration.test_sampling import assert_homogeneous

    _, tree = servers
    before = tree.metrics()
    plain = served_draws(plain_server.client, 2 * N_SERVED)
    got = served_draws(tree.client, N_SERVED)
    m = tree.metrics()
    assert_homogeneous(plain, got, "served hybrid tree")
    assert accepted_by_source(before, m, "copy") + accepted_by_source(before, m, "both") > 0, m
    # Other requests' copies are among these trees too (the draws before each
    # request's are in the store), a few per 200 draws: too few to assert on.
    # The next test accepts them by construction.


def test_a_seeded_sample_is_the_same_when_other_requests_copies_are_accepted(servers):
    """A seeded request at T = 1 takes each position's randomness from (seed,
    position) (test_seeded), so asking it again must give the same answer although
    the second time the store holds the first answer: its copies, which the
    request's own history does not hold, are proposed beside the drafter's nodes
    and accepted where the drafter's are not. A rule that let a copy change what
    is sampled would change the answer."""
    _, tree = servers
    question = "Invent a name for a new colour and describe it."  # asked only here

    def ask():
        before = tree.metrics()
        resp = chat(tree.client, question, temperature=1.0, seed=4321, extra_body={
            "ignore_eos": True, "return_token_ids": True, "cache_salt": "seeded-repeat"})
        return resp.choices[0].token_ids, accepted_by_source(before, tree.metrics(),
                                                             "other_requests")

    first, _ = ask()
    again, copied = ask()
    assert again == first
    # 64 sampled tokens: the drafter's few guesses a step miss many of them
    assert copied > 0, copied


def test_top_logprobs_beside_specific_token_logprobs(servers, plain_server):
    """Two ordinary chat requests that once took the engine down: A asks top-2
    logprobs of a greedy answer (it gets trees), B, sent while A runs, logprobs
    of five specific tokens (it gets none). Both are answered as plain vLLM
    answers them, each with its logprobs, and the server stays up."""
    _, tree = servers
    a = {"logprobs": True, "top_logprobs": 2, "max_tokens": 96}
    b = {"logprobs": True, "max_tokens": 24,
         "extra_body": {"logprob_token_ids": [11, 12, 13, 14, 15]}}

    def pair(client):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(chat, client, QUESTIONS[4], **a)
            time.sleep(1.0)  # B joins A's decode steps
            return first.result(), pool.submit(chat, client, QUESTIONS[2], **b).result()

    (ta, tb), (pa, pb) = pair(tree.client), pair(plain_server.client)
    assert ta.choices[0].message.content == pa.choices[0].message.content
    assert tb.choices[0].message.content == pb.choices[0].message.content
    for got, want in ((ta, pa), (tb, pb)):
        entries = got.choices[0].logprobs.content
        assert len(entries) == got.usage.completion_tokens == want.usage.completion_tokens
        assert [e.token for e in entries] == [e.token for e in want.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in ta.choices[0].logprobs.content)
    assert tree.proc.poll() is None
    assert chat(tree.client, QUESTIONS[0]).choices[0].message.content


def test_a_thinking_budget_is_refused_by_name(servers, plain_server):
    """``thinking_token_budget`` (served by plain vLLM with a reasoning config,
    both servers have one) cannot be applied on tree nodes: the tree server
    refuses the request with a 400 naming it, and serves the next one."""
    _, tree = servers
    kw = {"max_tokens": 8, "extra_body": {"thinking_token_budget": 4}}
    assert chat(plain_server.client, QUESTIONS[1], **kw).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(tree.client, QUESTIONS[1], **kw)
    assert chat(tree.client, QUESTIONS[0]).choices[0].message.content


# The request-mix property test's short run (the long one: docs/reliability.md).
CI_MIXES = 6


def test_request_mixes_are_served_as_plain_vllm_serves_them(servers, plain_server):
    """Seeded mixes of 2 to 8 concurrent requests over every field the API
    accepts (``bench.request_mix``), sent to both servers: each request gets
    plain's status class (or a 400 naming a field only speculation refuses), no
    5xx, plain's text when greedy, every field and count it asked for, and the
    tree server stays up."""
    from vllm_treespec.bench.request_mix_run import mixes, run_mix

    _, tree = servers
    for i, mix in mixes(seed=0, count=CI_MIXES, sizes=(2, 8)):
        result = run_mix(plain_server.base_url, tree.base_url, mix)
        assert not result["problems"], (i, result["problems"], mix)
