"""Tree metrics on ``/metrics`` with two API-server processes.

With ``--api-server-count 2`` vLLM serves ``/metrics`` from Prometheus'
multiprocess mode, which sums a counter over processes, and each step's stats
(vLLM's and the trees', which ride on them) reach one of the two API servers:
every tree must still be counted once. The truth is vLLM's own speculative
decoding counters: with the adaptive budget off, every scheduled draft is a
verified node and every request-step with drafts a tree.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest

from tests.integration.conftest import pinned_kernels
from vllm_treespec.bench.server import Server, metric_sum

pytestmark = pytest.mark.vllm

# vLLM logs each request it adds (--enable-log-requests) with its process prefix.
ACCESS_LINE = re.compile(r"\((ApiServer_\d+) pid=\d+\).*Added request chatcmpl-")
QUESTIONS = ["Name three fruits.", "What is the capital of France?", "Count to five.",
             "Say hello in Spanish.", "What colour is the sky?", "Name a large animal.",
             "What is 2 plus 2?", "Name a programming language."]


def ask(base_url: str, question: str) -> None:
    """One request on a connection of its own (either API server may accept it:
    they share one listening socket)."""
    body = json.dumps({"model": "smollm2", "max_tokens": 16, "temperature": 0.0,
                       "messages": [{"role": "user", "content": question}]}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Connection": "close"})
    answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
    assert answer["choices"][0]["message"]["content"]


def chat_servers(log) -> list[str]:
    """The API server (vLLM's log prefix) of each chat request served so far, in order."""
    return [m.group(1) for line in log.read_text().splitlines()
            if (m := ACCESS_LINE.search(line))]


def test_each_tree_counted_once_with_two_api_servers(target_dir, random_drafter, tmp_path):
    spec = {"method": "eagle3_tree", "model": str(random_drafter), "num_nodes": 8,
            "depth": 3, "top_k": 4, "adaptive": False}
    args = ["--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
            "--max-num-seqs", "4", "--compilation-config", '{"mode": 0}',
            "--api-server-count", "2", "--enable-log-requests"]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_LOG_STATS_INTERVAL": "2", **pinned_kernels(),
           # vLLM's per-process log prefix, uncoloured (chat_servers reads it).
           "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_COLOR": "0"}
    log = tmp_path / "server.log"
    with Server(str(target_dir), args, spec, log, served_name="smollm2",
                env=env, startup_timeout_s=600) as server:
        # Until both have served, the second one last.
        for i in range(60):
            ask(server.base_url, QUESTIONS[i % len(QUESTIONS)])
            served = chat_servers(log)
            if served[-1:] == ["ApiServer_1"] and "ApiServer_0" in served:
                break
        else:
            pytest.fail(f"requests did not reach both API servers: {served}")
        # One step's stats are recorded at once in one API server; a scrape that
        # reads the other's files while it records may see half: read again then.
        for _ in range(10):
            m = server.metrics()
            trees = metric_sum(m, "vllm_treespec:trees_total")
            truth = (metric_sum(m, "vllm:spec_decode_num_drafts_total"),
                     metric_sum(m, "vllm:spec_decode_num_draft_tokens_total"),
                     trees + metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total"))
            ours = (trees, metric_sum(m, "vllm_treespec:draft_nodes_total"),
                    metric_sum(m, "vllm_treespec:emitted_tokens_total"))
            if ours == truth:
                break
            time.sleep(1.0)
        assert trees > 0
        assert ours == truth  # trees, draft nodes, emitted tokens
        # A gauge is one series, not one per process.
        assert len([k for k in m if k.startswith("vllm_treespec:mean_acceptance_length")]) == 1
