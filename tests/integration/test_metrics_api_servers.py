"""Tree metrics on ``/metrics`` with two API-server processes.

With ``--api-server-count 2`` vLLM serves ``/metrics`` from Prometheus'
multiprocess mode, which sums a counter over processes: every tree must still
be counted once. The engine's stats file is the truth the frontend mirrors
(the worker's cumulative counters); ``/metrics`` may lag it by one log
interval and must never exceed it.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest

from vllm_treespec.bench.server import Server, metric_sum
from vllm_treespec.observability import STATS_ENV, StatsFile

pytestmark = pytest.mark.vllm

ACCESS_LINE = re.compile(r"\((ApiServer_\d+) pid=\d+\).*POST /v1/chat/completions")
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
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    spec = {"method": "eagle3_tree", "model": str(random_drafter), "num_nodes": 8,
            "depth": 3, "top_k": 4, "adaptive": False}
    args = ["--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
            "--max-num-seqs", "4", "--compilation-config", '{"mode": 0}',
            "--api-server-count", "2"]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           STATS_ENV: str(stats_dir), "VLLM_LOG_STATS_INTERVAL": "2",
           # vLLM's per-process log prefix, uncoloured (chat_servers reads it).
           "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_COLOR": "0"}
    log = tmp_path / "server.log"
    with Server(str(target_dir), args, spec, log, served_name="smollm2",
                env=env, startup_timeout_s=600) as server:
        # Until both have served, the second one last: the first API server then
        # hears of the last trees only through its periodic re-read.
        for i in range(60):
            ask(server.base_url, QUESTIONS[i % len(QUESTIONS)])
            served = chat_servers(log)
            if served[-1:] == ["ApiServer_1"] and "ApiServer_0" in served:
                break
        else:
            pytest.fail(f"requests did not reach both API servers: {served}")
        # The engine's step after the last request forces the file's last write.
        truth, deadline = None, time.time() + 10
        while time.time() < deadline:
            time.sleep(1.0)
            now = StatsFile.read(str(stats_dir / "engine-0.json"))
            if now is not None and now == truth:
                break
            truth = now
        assert truth is not None and truth["trees"] > 0
        seen = []
        deadline = time.time() + 30  # a few log intervals
        while time.time() < deadline:
            seen.append(metric_sum(server.metrics(), "vllm_treespec:trees_total"))
            assert seen[-1] <= truth["trees"], (seen, truth["trees"])  # never twice
            if seen[-1] == truth["trees"]:
                break
            time.sleep(1.0)
        assert seen[-1] == truth["trees"], (seen, truth["trees"])
        m = server.metrics()
        assert metric_sum(m, "vllm_treespec:emitted_tokens_total") == truth["emitted"]
        # The file is final once the engine idles (its last write is forced), so
        # it agrees with vLLM's own count of the draft tokens it scheduled
        # (adaptive off: every scheduled draft is a verified node).
        assert truth["nodes"] == metric_sum(m, "vllm:spec_decode_num_draft_tokens_total")
        # A gauge is one series, not one per process.
        assert len([k for k in m if k.startswith("vllm_treespec:mean_acceptance_length")]) == 1
