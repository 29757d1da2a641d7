"""The soak's short version: plain vLLM and a fixed branching tree with injected
invalid trees, under a small seeded load with aborts, fallbacks and bad input,
behind `vllm-treespec serve`."""

import json

import pytest

pytestmark = pytest.mark.vllm


def test_short_soak_keeps_every_promise(tmp_path):
    """Every 3rd validated drafting step of the fixed tree server gets a tree with an
    impossible token: each is caught and dumped, its request decodes without drafts
    that step, and every other promise holds (no lost request, quiet answers and
    greedy answers under load as plain vLLM's, preemption, memory, no other dump).
    One tree server (CI time): a clean one would keep the same promises.

    Preemption must happen on both servers (the soak counts a server that was
    never preempted as a violation: it did not exercise the path). The soak's
    preemption burst makes it happen by construction (11 requests that fit the
    11 blocks of the 12-block cache that hold KV at once and must each grow into a
    second block); the mix alone once left the tree server unpreempted."""
    from vllm_treespec.bench.soak import FAULT_SERVER, main

    rc = main(["--requests", "32", "--concurrency", "16", "--trees", "", "--quiet", "4",
               "--quiet-tokens", "32",
               "--warmup", "8", "--kv-tokens", "1536", "--max-tokens-cap", "48",
               "--invalid-trees", "3", "--eager", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, (tmp_path / "soak.md").read_text()
    assert result["violations"] == []
    assert set(result["servers"]) == {"plain", FAULT_SERVER}
    tree = result["servers"][FAULT_SERVER]
    assert tree["trees"] > 0  # the load really went through trees
    assert tree["burst_preemptions"] > 0 and result["servers"]["plain"]["burst_preemptions"] > 0
    assert tree["requests"]["invalid"] > 0 and tree["requests"]["abort"] > 0
    assert tree["greedy_under_load"]["compared"] > 10
    assert tree["invariant_dumps"] >= 3  # every one injected (any other is a violation)
    assert tree["draft_faults"] == 0
