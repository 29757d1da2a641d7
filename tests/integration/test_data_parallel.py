"""Data parallelism: eagle3_tree under ``--data-parallel-size 2`` on the CPU.

A dense target's DP ranks are independent engines (vLLM's ``EngineCoreProc``, each
with its own scheduler, runner and adaptive budget) behind one API server that
balances requests between them; one core a rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
The DP = 2 tree server with the defaults (adaptive budget, copy branches, the shipped
head) answers chat prompts, sent all at once, with the DP = 2 plain server's greedy
text, and both of its engines drafted trees (vLLM's per-engine labels on our
series). At T > 0 its draws pass ``test_sampling``'s homogeneity tests against the
plain DP = 2 server's (``test_http``'s served draws: copies and drafter nodes as
siblings). Two "nodes" on loopback (node 0: the API server and rank 0; node 1:
rank 1 ``--headless``) answer as the plain DP = 2 server, both engines drafting,
and leave no process behind. A mixture-of-experts target with DP is refused by name
(``test_config_errors``); docs/scale-out.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import pinned_kernels
from tests.integration.test_http import N_SERVED, served_draws
from tests.integration.test_tensor_parallel import (ALL_QUESTIONS, assert_all_gone,
                                                    stop_and_assert_nothing_left)
from vllm_treespec.bench.server import Server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SERVE_ARGS = ["--data-parallel-size", "2", "--dtype", "float32", "--max-model-len", "1024",
              "--seed", "0", "--max-num-seqs", "8", "--compilation-config", '{"mode": 0}']
MAX_TOKENS = 48
QUESTIONS = ALL_QUESTIONS  # 30


def start(target: Path, log: Path, spec: dict | None) -> Server:
    server = Server(str(target), SERVE_ARGS, spec, log, served_name="smollm2",
                    env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                         **DP_ENV, **pinned_kernels()},
                    startup_timeout_s=600)
    server.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
    return server


def answers(client) -> list[str]:
    """Greedy answers to every question, all in flight at once (both engines busy)."""
    def chat(q):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": q}],
            max_tokens=MAX_TOKENS, temperature=0.0).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(chat, QUESTIONS))


def per_engine(metrics: dict[str, float], name: str) -> dict[str, float]:
    """{engine label: value} of one series."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(name + "{"):
            engine = key.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = out.get(engine, 0.0) + value
    return out


@pytest.fixture(scope="module")
def plain_dp(target_dir, tmp_path_factory):
    server = start(target_dir, tmp_path_factory.mktemp("dp") / "plain.log", None)
    try:
        reference = answers(server.client)
        draws = served_draws(server.client, 2 * N_SERVED)
    finally:
        stop_and_assert_nothing_left(server, busy=False)
    return reference, draws


def test_dp2_tree_server_answers_and_samples_as_the_dp2_plain_server(plain_dp, target_dir,
                                                                     tmp_path):
    from tests.integration.test_sampling import assert_homogeneous
    from vllm_treespec.assets import committed_drafter_dir

    reference, plain_draws = plain_dp
    tree = start(target_dir, tmp_path / "tree.log",
                 {"method": "eagle3_tree", "model": str(committed_drafter_dir())})
    try:
        got = answers(tree.client)
        m = tree.metrics()
        draws = served_draws(tree.client, N_SERVED)
    finally:
        stop_and_assert_nothing_left(tree, busy=True)
    assert got == reference
    requests = per_engine(m, "vllm:request_success_total")
    trees = per_engine(m, "vllm_treespec:trees_total")
    assert set(requests) == {"0", "1"} and min(requests.values()) > 0, requests
    # Both budgets drafted: holds on any supported CPU for the reason the TP = 2
    # server test gives (a fresh budget drafts while verifying 2 tokens a request
    # costs under ~1.45x one).
    assert set(trees) == {"0", "1"} and min(trees.values()) > 0, trees
    assert_homogeneous(plain_draws, draws, "DP = 2 tree server")


def test_dp2_across_two_nodes_on_loopback(plain_dp, target_dir, tmp_path):
    """Two "nodes" on one machine, as docs/scale-out.md runs them on two: node 0
    serves the API and DP rank 0, node 1 runs rank 1 headless and joins over
    127.0.0.1 (its own process group, one core each). Same greedy text as the plain
    DP = 2 server, both engines served requests and drafted trees, and every
    process of both nodes is gone after SIGTERM."""
    import subprocess
    import sys

    import psutil

    from vllm_treespec.assets import committed_drafter_dir
    from vllm_treespec.bench.server import free_port

    reference, _ = plain_dp
    spec = {"method": "eagle3_tree", "model": str(committed_drafter_dir())}
    node_args = SERVE_ARGS + [
        "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(free_port())]
    kv = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
          **pinned_kernels()}
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "vllm_treespec", "serve", str(target_dir), "--headless",
             "--data-parallel-start-rank", "1", *node_args,
             "--speculative-config", json.dumps(spec)],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **kv, "VLLM_CPU_OMP_THREADS_BIND": "1"})
    family = []
    try:
        node0 = Server(str(target_dir), node_args, spec, tmp_path / "node0.log",
                       served_name="smollm2", env={**kv, "VLLM_CPU_OMP_THREADS_BIND": "0"},
                       startup_timeout_s=600)
        node0.client = openai.OpenAI(base_url=node0.base_url + "/v1", api_key="none",
                                     timeout=300)
        family = [p.pid for root in (node0.proc.pid, node1.pid)
                  for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]]
        try:
            got = answers(node0.client)
            m = node0.metrics()
        finally:
            node0.close()
    finally:
        node1.terminate()
        try:
            node1.wait(60)
        except subprocess.TimeoutExpired:
            node1.kill()
    assert got == reference
    requests = per_engine(m, "vllm:request_success_total")
    trees = per_engine(m, "vllm_treespec:trees_total")
    assert set(requests) == {"0", "1"} and min(requests.values()) > 0, requests
    assert set(trees) == {"0", "1"} and min(trees.values()) > 0, trees
    assert_all_gone(family)
