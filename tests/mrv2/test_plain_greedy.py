"""Plain vLLM on Model Runner V2 (MRV2) under Triton's interpreter decodes as plain vLLM
on V1: the harness a tree adapter on MRV2 will be tested with (docs/mrv2.md) runs the
runner it says it runs, with our plugin installed, and changes no token.

Run with ``bash scripts/test-mrv2.sh``; skipped otherwise (harness.GATE).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import base_engine
from tests.mrv2 import harness

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(not harness.enabled(),
                       reason="MRV2 under Triton's interpreter: bash scripts/test-mrv2.sh"),
    pytest.mark.skipif(not harness.has_mrv2(), reason="this vLLM has no MRV2 CPU runner"),
]

MAX_TOKENS = 16


def _spec(target_dir, prompts) -> dict:
    return {"engine": base_engine(target_dir), "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS}}


def test_plain_mrv2_greedy_equals_plain_v1(target_dir, chat_prompts, tmp_path):
    spec = _spec(target_dir, chat_prompts)
    v2 = harness.run_engine(spec, tmp_path, "plain-v2", "v2")
    v1 = harness.run_engine(spec, tmp_path, "plain-v1", "v1")
    # The runners are the ones asked for, the plugin loaded in both, and vLLM said so.
    assert (v2["runner"], v2["runner_mro"][1]) == (harness.V2_RUNNER, harness.V2_BASE)
    assert v1["runner"] == harness.V1_RUNNER
    assert v2["plugin_registered"] and v1["plugin_registered"]
    assert "Using V2 Model Runner" in (tmp_path / "plain-v2.log").read_text()
    assert "Using V2 Model Runner" not in (tmp_path / "plain-v1.log").read_text()
    assert [len(o) for o in v2["outputs"]] == [MAX_TOKENS] * len(chat_prompts)
    assert v2["outputs"] == v1["outputs"]


def test_mrv2_is_refused_without_the_interpreter_backend(target_dir, chat_prompts, tmp_path):
    """Control: the stub is what lets MRV2 start here, so a run without it cannot pass
    for an MRV2 run."""
    with pytest.raises(harness.EngineFailed) as failed:
        harness.run_engine(_spec(target_dir, chat_prompts[:1]), tmp_path, "no-stub", "v2",
                           interpreter_backend=False)
    assert "Model Runner V2 requires Triton" in failed.value.log
