"""OpenAI-compatible HTTP through `vllm-treespec serve` with eagle3_tree.

Two servers on 127.0.0.1, same flags: plain vLLM first (reference answers),
then eagle3_tree with the shipped drafter and a branching tree on every step.
Driven by the official `openai` client: chat and completions, streaming, n>1,
stop strings, logprobs, concurrent requests, and a client that disconnects
mid-stream.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import pinned_kernels
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
]
MAX_TOKENS = 64


SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
              "--max-num-seqs", "8", "--compilation-config", '{"mode": 0}']


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
def servers(target_dir, tmp_path_factory):
    from vllm_treespec.assets import committed_drafter_dir

    logs = tmp_path_factory.mktemp("servers")
    plain = start(target_dir, logs / "plain.log", None)
    try:
        reference = collect(plain.client)
    finally:
        plain.close()
    # The shipped drafter with the budget off: every step verifies a branching
    # tree and accepts real drafts, so logprobs, stop strings, streaming and n>1
    # go through multi-token tree steps (a random drafter accepts nothing, and
    # the adaptive budget would switch it off).
    spec = {"method": "eagle3_tree", "model": str(committed_drafter_dir()), "num_nodes": 12,
            "depth": 4, "top_k": 4, "adaptive": False}
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


def test_n_greater_than_one_at_temperature(servers):
    _, tree = servers
    resp = tree.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[3]}],
        max_tokens=24, temperature=1.0, n=4, seed=7)
    assert len(resp.choices) == 4
    assert all(c.message.content for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1
    # A seeded request reproduces, trees and off steps alike (the noise of every
    # position is keyed by seed and position; see test_seeded).
    again = tree.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[3]}],
        max_tokens=24, temperature=1.0, n=4, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]


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


def test_tree_metrics_on_prometheus_endpoint(servers):
    _, tree = servers
    chat(tree.client, QUESTIONS[1])
    m = tree.metrics()  # no wait: the counters came with the answer's last step
    trees = metric_sum(m, "vllm_treespec:trees_total")
    assert trees > 0, m
    # At least vLLM's own counts (the budget is off: every draft is a verified
    # node); more by the trees of a step whose request the disconnect test
    # aborted before vLLM's scheduler took the step's results (vLLM skips those).
    # With one API server, vLLM's logging stat logger ran on the same steps'
    # stats after the tree logger took its payload out.
    drafts = metric_sum(m, "vllm:spec_decode_num_drafts_total")
    assert drafts <= trees <= drafts + 8, (trees, drafts)  # 8: one step's batch at most
    assert metric_sum(m, "vllm_treespec:draft_nodes_total") >= metric_sum(
        m, "vllm:spec_decode_num_draft_tokens_total")
    # Trees accepted drafts (test_greedy_answers_equal_plain_vllm and the rest
    # then checked multi-token steps, not just bonus tokens).
    assert metric_sum(m, "vllm_treespec:mean_acceptance_length") >= 1.3, m
    assert any(k.startswith("vllm_treespec:stage_seconds_total{") and 'stage="verify_forward"' in k
               for k in m)
    # vLLM's logging stat logger really ran on those steps (it would fail on a
    # tree payload left in the stats), and so did the tree logger's summary.
    log = tree.log_path.read_text()
    assert "SpecDecoding metrics" in log and "eagle3_tree: mean acceptance length" in log


def test_worker_returns_free_heap_when_the_engine_idles(servers):
    """The tree worker trims its heap when its last request finishes (host_heap):
    the first idle moment always trims, and the worker logs it."""
    _, tree = servers
    chat(tree.client, QUESTIONS[2])
    time.sleep(1)  # the engine's next step tells the worker the request finished
    assert "eagle3_tree: engine idle, returned" in tree.log_path.read_text()


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
