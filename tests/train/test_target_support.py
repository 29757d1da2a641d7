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
    ("qwen3", {}, "target model_type 'qwen3'; allowed: ['llama', 'mistral']"),
    ("qwen2.5", {}, "target model_type 'qwen2'"),
    ("llama3", {}, "target rope_type 'llama3'; allowed: 'default'"),
    ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 8192}},
     "target rope_type 'yarn'"),
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


def test_a_llama_target_with_default_rope_is_accepted():
    from transformers import LlamaConfig

    from vllm_treespec.train.drafter_config import DrafterConfig

    assert DrafterConfig.unsupported_target(LlamaConfig(hidden_size=64)) is None
