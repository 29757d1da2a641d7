"""The soak's short version: plain vLLM and a fixed branching tree under a small
seeded load with aborts, fallbacks and bad input, behind `vllm-treespec serve`."""

import json

import pytest

pytestmark = pytest.mark.vllm


def test_short_soak_keeps_every_promise(tmp_path):
    from vllm_treespec.bench.soak import main

    rc = main(["--requests", "32", "--concurrency", "16", "--trees", "fixed", "--quiet", "4",
               "--warmup", "8", "--kv-tokens", "1536", "--max-tokens-cap", "48",
               "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, (tmp_path / "soak.md").read_text()
    assert result["violations"] == []
    tree = result["servers"]["fixed"]
    assert tree["trees"] > 0  # the load really went through trees
    assert tree["preemptions"] > 0 and result["servers"]["plain"]["preemptions"] > 0
    assert tree["requests"]["invalid"] > 0 and tree["requests"]["abort"] > 0
    assert tree["greedy_under_load"]["compared"] > 10


def test_injected_invalid_trees_are_dumped_and_served_without_drafts(tmp_path):
    """Every 3rd validated drafting step of the tree server gets a tree with an
    impossible token: each is caught and dumped, its request decodes without
    drafts that step, and every promise of the soak still holds."""
    from vllm_treespec.bench.soak import main

    rc = main(["--requests", "12", "--concurrency", "8", "--trees", "fixed", "--quiet", "3",
               "--warmup", "4", "--kv-tokens", "1536", "--max-tokens-cap", "32",
               "--allow-no-preemption", "--invalid-trees", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, (tmp_path / "soak.md").read_text()
    tree = result["servers"]["fixed"]
    assert tree["invariant_dumps"] >= 3 and tree["trees"] > 0
    assert result["servers"]["plain"]["invariant_dumps"] == 0
