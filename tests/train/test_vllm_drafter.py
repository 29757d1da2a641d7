"""The shipped drafter in stock vLLM ``eagle3``: it loads, greedy output equals
decoding without speculation, and the training-time recurrence reproduces the
engine's draft tokens at every step (pre-norm feedback, advancing positions)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def verify_result(tmp_path_factory):
    from vllm_treespec.assets import ensure_assets

    assets = ensure_assets()
    out = tmp_path_factory.mktemp("verify") / "verify.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_treespec.train.verify", "--target", str(assets.target),
         "--drafter", str(assets.drafter), "--prompts", "4", "--max-tokens", "64", "--check-greedy",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_greedy_output_is_unchanged_by_speculation(verify_result):
    assert verify_result["greedy_identical"] == [True] * 4


def test_training_recurrence_reproduces_vllm_drafts(verify_result):
    v = verify_result["variants"]
    assert v["engine"]["rounds"] > 40
    engine = v["engine"]["match_per_step"]
    assert min(engine) >= 0.98, engine
    # the alternatives a trainer could plausibly implement are told apart
    assert v["postnorm_feedback"]["match_per_step"][1] < engine[1] - 0.2
    assert v["fc_every_step"]["match_per_step"][1] < engine[1] - 0.1


def test_shipped_drafter_is_accepted(verify_result):
    # A regression guard: the shipped head reaches 1.44 on these 4 prompts (greedy,
    # deterministic) and 1.56 on the README's benchmark; an untrained or broken head
    # (wrong d2t, wrong aux layers) stays near 1.0-1.06.
    assert verify_result["acceptance_length"] > 1.3, verify_result
