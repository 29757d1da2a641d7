"""The soak's short version: plain vLLM, a fixed branching tree, and the same tree
with injected invalid trees, under a small seeded load with aborts, fallbacks and
bad input, behind `vllm-treespec serve`."""

import json

import pytest

pytestmark = pytest.mark.vllm


def test_short_soak_keeps_every_promise(tmp_path):
    """Every promise holds on the fixed tree server. On the fault server every 3rd
    validated drafting step gets a tree with an impossible token: each is caught and
    dumped, its request decodes without drafts that step, and every other promise
    (no lost request, quiet answers equal to plain vLLM's) still holds."""
    from vllm_treespec.bench.soak import FAULT_SERVER, main

    rc = main(["--requests", "32", "--concurrency", "16", "--trees", "fixed", "--quiet", "4",
               "--quiet-tokens", "32",
               "--warmup", "8", "--kv-tokens", "1536", "--max-tokens-cap", "48",
               "--invalid-trees", "3", "--eager", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, (tmp_path / "soak.md").read_text()
    assert result["violations"] == []
    tree = result["servers"]["fixed"]
    assert tree["trees"] > 0  # the load really went through trees
    assert tree["preemptions"] > 0 and result["servers"]["plain"]["preemptions"] > 0
    assert tree["requests"]["invalid"] > 0 and tree["requests"]["abort"] > 0
    assert tree["greedy_under_load"]["compared"] > 10
    assert tree["invariant_dumps"] == 0
    faulty = result["servers"][FAULT_SERVER]
    assert faulty["invariant_dumps"] >= 3 and faulty["trees"] > 0
    assert faulty["draft_faults"] == 0
