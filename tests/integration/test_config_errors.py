"""Bad eagle3_tree settings fail at startup, naming the key, the value and the range."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.vllm


def engine_config(target, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_treespec

    vllm_treespec.register()  # as vLLM's plugin loader does in every process
    args = EngineArgs(model=str(target), speculative_config=spec, **kw)
    return args.create_engine_config()


@pytest.mark.parametrize("extra, needle", [
    ({"depth": 0}, "'depth' has invalid value 0; allowed: an integer in [1, 32]"),
    ({"num_nodes": 1000}, "'num_nodes' has invalid value 1000; allowed: an integer in [1, 256]"),
    ({"top_k": "8"}, "'top_k' has invalid value '8'; allowed: an integer in [1, 64]"),
    ({"num_nodes": 64, "depth": 1, "top_k": 4}, "holds at most 4 candidates"),
    ({"exec_mode": "turbo"}, "'exec_mode' has invalid value 'turbo'"),
    ({"choices": [[0], [2, 1]]}, "'choices[1]' has invalid value [2, 1]"),
    ({"width": 3}, "unknown speculative-config key(s) ['width']"),
    ({"num_speculative_tokens": 5}, "'num_speculative_tokens' has invalid value 5"),
    ({"validate_invariants": 1}, "'validate_invariants' has invalid value 1; allowed: true or false"),
])
def test_bad_values_are_rejected_before_loading(target_dir, random_drafter, extra, needle):
    from vllm_treespec.config import TreeSpecConfigError

    spec = {"method": "eagle3_tree", "model": str(random_drafter), **extra}
    with pytest.raises(TreeSpecConfigError) as err:
        engine_config(target_dir, spec)
    assert needle in str(err.value)


def test_missing_drafter_is_rejected(target_dir):
    from vllm_treespec.config import TreeSpecConfigError

    with pytest.raises(TreeSpecConfigError, match="'model' has invalid value None"):
        engine_config(target_dir, {"method": "eagle3_tree", "num_nodes": 8})


def test_async_scheduling_is_refused_with_a_reason(target_dir, random_drafter):
    from vllm_treespec.config import TreeSpecConfigError

    with pytest.raises(TreeSpecConfigError, match="'async_scheduling'"):
        engine_config(target_dir, {"method": "eagle3_tree", "model": str(random_drafter)},
                      async_scheduling=True)


def test_good_config_becomes_stock_eagle3_plus_tree_settings(target_dir, random_drafter):
    cfg = engine_config(target_dir, {"method": "eagle3_tree", "model": str(random_drafter),
                                     "num_nodes": 20, "depth": 5, "top_k": 4})
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.speculative_config.num_speculative_tokens == 20
    assert cfg.additional_config["eagle3_tree"]["depth"] == 5
    assert cfg.parallel_config.worker_cls.endswith("TreeCPUWorker")
    assert cfg.scheduler_config.async_scheduling is False


def test_stock_methods_are_untouched(target_dir, random_drafter):
    cfg = engine_config(target_dir, {"method": "eagle3", "model": str(random_drafter),
                                     "num_speculative_tokens": 3})
    assert cfg.speculative_config.method == "eagle3"
    assert "eagle3_tree" not in (cfg.additional_config or {})
    assert not cfg.parallel_config.worker_cls.endswith("TreeCPUWorker")


def test_serve_exits_with_the_message_at_startup(target_dir, random_drafter):
    spec = {"method": "eagle3_tree", "model": str(random_drafter), "depth": 99}
    proc = subprocess.run([sys.executable, "-m", "vllm_treespec", "serve", str(target_dir),
                           "--speculative-config", json.dumps(spec)],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "'depth' has invalid value 99; allowed: an integer in [1, 32]" in proc.stderr
