"""`train-drafter` refuses a target it cannot train a head for before any stage runs."""

from __future__ import annotations

import json

import pytest

from tests.integration.twins import TWINS


def _target(tmp_path, name: str, **changes):
    target = tmp_path / name
    target.mkdir()
    (target / "config.json").write_text(json.dumps(dict(TWINS[name].config(1, 2), **changes)))
    return target


@pytest.mark.parametrize("name, changes, needle", [
    ("qwen3-moe", {}, "target model_type 'qwen3_moe'; allowed: ['llama', 'mistral', 'qwen2', "
                      "'qwen3']"),
    ("llama3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16,
                                 "long_factor": [1.0] * 16,
                                 "original_max_position_embeddings": 8192}},
     "target rope_type 'longrope'; allowed: ['default', 'llama3', 'yarn']"),
])
def test_an_unsupported_target_is_refused_before_any_stage(tmp_path, capsys, name, changes,
                                                           needle):
    from vllm_treespec.train.cli import main

    target = _target(tmp_path, name, **changes)
    work = tmp_path / "work"
    code = main(["--target", str(target), "--out", str(tmp_path / "head"),
                 "--work", str(work)])
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not work.exists()  # no stage ran, nothing was written


@pytest.mark.parametrize("name, changes", [
    ("llama3", {}), ("qwen3", {}), ("qwen2.5", {}), ("mistral", {}),
    ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 8192}}),
])
def test_the_targets_people_serve_are_accepted(tmp_path, name, changes):
    from transformers import AutoConfig

    from vllm_treespec.train.drafter_config import DrafterConfig

    config = AutoConfig.from_pretrained(_target(tmp_path, name, **changes))
    assert DrafterConfig.unsupported_target(config) is None
    head = DrafterConfig.from_target(config, 1024, (1, 2, 3))
    # the head rotates as the target does, and keeps Qwen2's q/k/v biases
    assert head.rope_parameters["rope_type"] == (changes.get("rope_scaling") or config.rope_parameters
                                      or {}).get("rope_type", "default")
    assert head.attention_bias == (name == "qwen2.5")
    assert DrafterConfig.from_hf_dict(head.to_hf_dict("float32")) == head
