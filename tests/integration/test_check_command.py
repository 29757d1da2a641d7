"""`vllm-treespec check TARGET DRAFTER`: the startup's own verdict, from configs only."""

from __future__ import annotations

import json

import pytest

from tests.integration.drafters import random_eagle3_drafter

pytestmark = pytest.mark.vllm


def run_check(capsys, *argv: str) -> tuple[int, str]:
    import os

    from vllm_treespec.commands import check

    before = os.environ.get("VLLM_LOGGING_LEVEL")
    code = check.main(list(argv))
    # Servers the later tests start inherit this process's environment (a leaked
    # level once hid the INFO lines they read).
    assert os.environ.get("VLLM_LOGGING_LEVEL") == before
    # vLLM's own log lines may come first (its logger writes to stdout)
    out = capsys.readouterr().out
    return code, out[out.find("served: ") if "served: " in out else out.find("refused"):]


def test_a_pair_that_serves_is_described(capsys, target_dir, random_drafter):
    code, out = run_check(capsys, str(target_dir), str(random_drafter),
                          "--speculative-config", '{"num_nodes": 12, "depth": 4}')
    assert code == 0, out
    assert out.startswith("served: every startup check that reads configs passed"), out
    assert "target: LlamaForCausalLM (model_type 'llama'), 30 layers, hidden size 576" in out
    assert "head: original EAGLE-3 layout, LlamaForCausalLMEagle3" in out
    assert "reads: target layers [2, 15, 27] of hidden size 576" in out
    assert "vocabulary: 4096 draft tokens of 49152, mapped by d2t" in out
    assert "num_nodes=12" in out and "depth=4" in out


def test_a_head_with_no_map_and_the_full_vocabulary(capsys, target_dir, tmp_path):
    head = random_eagle3_drafter(target_dir, tmp_path / "full", draft_vocab=49152)
    code, out = run_check(capsys, str(target_dir), str(head))
    assert code == 0, out
    assert "vocabulary: the full vocabulary (49152 tokens), no map" in out


@pytest.mark.parametrize("spec, engine, needle", [
    ({"top_k": 0}, {}, "'top_k' has invalid value 0"),
    ({}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
    ({}, {"hf_overrides": {"sliding_window": 64,
                           "layer_types": ["sliding_attention"] * 30}},
     "sliding-window attention layers (window 64)"),
])
def test_a_pair_the_server_would_refuse_is_refused_the_same_way(capsys, target_dir,
                                                                random_drafter, spec,
                                                                engine, needle):
    code, out = run_check(capsys, str(target_dir), str(random_drafter),
                          "--speculative-config", json.dumps(spec),
                          "--engine-args", json.dumps(engine))
    assert code == 1, out
    assert out.startswith("refused: ") and needle in out, out


def test_a_head_for_another_target_is_refused(capsys, target_dir, tmp_path):
    config = json.loads((target_dir / "config.json").read_text())
    other = tmp_path / "wider-target"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(config, hidden_size=640)))
    head = random_eagle3_drafter(other, tmp_path / "head")
    code, out = run_check(capsys, str(target_dir), str(head))
    assert code == 1 and "trained on hidden states of size 640" in out, out
