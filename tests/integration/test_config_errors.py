"""Bad eagle3_tree settings fail at startup, naming the key, the value and the range."""

from __future__ import annotations

import json
import os
import re
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
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-treespec serve: error: eagle3_tree:"), last
    assert "'depth' has invalid value 99; allowed: an integer in [1, 32]" in last
    assert "Traceback" not in proc.stderr


def test_spec_method_flags_work_like_the_json_form(target_dir, random_drafter):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_treespec

    vllm_treespec.register()
    args = EngineArgs(model=str(target_dir), spec_method="eagle3_tree",
                      spec_model=str(random_drafter), speculative_config={"num_nodes": 6})
    cfg = args.create_engine_config()
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.additional_config["eagle3_tree"]["num_nodes"] == 6


def test_an_unsupported_vllm_version_is_refused(target_dir, random_drafter, monkeypatch):
    import vllm

    from vllm_treespec.config import TreeSpecConfigError
    from vllm_treespec.vllm_glue.versions import SUPPORTED

    monkeypatch.setattr(vllm, "__version__", "0.26.0")  # older than any release we support
    monkeypatch.delenv("VLLM_TREESPEC_ALLOW_UNTESTED_VLLM", raising=False)
    supported = re.escape(", ".join(SUPPORTED))
    with pytest.raises(TreeSpecConfigError,
                       match=rf"supports vLLM {supported}; found vLLM '0.26.0'"):
        engine_config(target_dir, {"method": "eagle3_tree", "model": str(random_drafter)})
    # stock methods are not ours to refuse
    engine_config(target_dir, {"method": "eagle3", "model": str(random_drafter),
                               "num_speculative_tokens": 2})


@pytest.mark.parametrize("engine_kw, needle", [
    ({"hf_overrides": {"rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]}}},
     "M-RoPE"),
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
     "KV connectors"),
    ({"kv_offloading_size": 1.0}, "KV-cache offloading"),
    ({"logits_processors": ["collections:OrderedDict"]}, "engine-level logits processors"),
])
def test_engine_features_trees_would_get_wrong_are_refused(target_dir, random_drafter,
                                                           engine_kw, needle):
    from vllm_treespec.config import TreeSpecConfigError

    spec = {"method": "eagle3_tree", "model": str(random_drafter)}
    with pytest.raises(TreeSpecConfigError, match="eagle3_tree does not support") as err:
        engine_config(target_dir, spec, **engine_kw)
    assert needle in str(err.value)
    # the same engine without a tree is vLLM's business
    engine_config(target_dir, None, **engine_kw)


def config_only_pair(target_dir, tmp_path, name: str, config: dict):
    """A target of which only ``config`` (and the SmolLM2 tokenizer) exists, no
    weights, and a random head for it: what a refusal from the config alone needs."""
    import shutil

    from tests.integration.drafters import random_eagle3_drafter

    target = tmp_path / f"{name}-config"
    target.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / file, target / file)
    (target / "config.json").write_text(json.dumps(config))
    return target, random_eagle3_drafter(target, tmp_path / "head", aux_layers=(1, 2, 3))


def test_an_mla_target_is_refused_by_name_before_anything_loads(target_dir, tmp_path):
    """DeepSeek-V2-Lite's attention fields (multi-head latent attention): refused
    from the config alone (no weights exist here), where it used to fail only
    after loading, in the tree-backend check, with a message about plugins."""
    from vllm_treespec.config import TreeSpecConfigError

    mla, head = config_only_pair(target_dir, tmp_path, "deepseek-v2-lite", {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 4096,
        "vocab_size": 49152, "tie_word_embeddings": False, "torch_dtype": "float32"})
    with pytest.raises(TreeSpecConfigError,
                       match=r"eagle3_tree does not support multi-head latent attention "
                             r"\(MLA; model_type 'deepseek_v2'\)"):
        engine_config(mla, {"method": "eagle3_tree", "model": str(head)},
                      max_model_len=1024)


def test_a_hybrid_mamba_target_is_refused_before_anything_loads(target_dir, tmp_path):
    """Jamba's layout (Mamba layers between attention layers), from its config alone:
    a Mamba state cannot be rolled back to the accepted path of a tree."""
    from vllm_treespec.config import TreeSpecConfigError

    hybrid, head = config_only_pair(target_dir, tmp_path, "jamba", {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 2,
        "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 2, "num_experts_per_tok": 1, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
        "max_position_embeddings": 4096, "vocab_size": 49152, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "float32"})
    with pytest.raises(TreeSpecConfigError,
                       match=r"eagle3_tree does not support models with non-attention"):
        engine_config(hybrid, {"method": "eagle3_tree", "model": str(head)},
                      max_model_len=1024)


def test_a_node_budget_over_the_step_token_budget_is_refused(target_dir, random_drafter):
    from vllm_treespec.config import TreeSpecConfigError

    spec = {"method": "eagle3_tree", "model": str(random_drafter), "num_nodes": 64,
            "depth": 4}
    kw = {"max_num_batched_tokens": 48, "enable_chunked_prefill": True, "max_model_len": 512}
    with pytest.raises(TreeSpecConfigError, match="'num_nodes' has invalid value 64; "
                                                  "allowed: 1..47 with engine argument "
                                                  "max_num_batched_tokens = 48"):
        engine_config(target_dir, spec, **kw)
    engine_config(target_dir, dict(spec, num_nodes=47), **kw)  # the largest that fits


def test_a_sliding_window_model_fails_before_its_weights_load(target_dir, random_drafter,
                                                              engine_dir):
    from tests.integration.conftest import base_engine, run_engine

    layers = 30  # SmolLM2-135M
    engine = base_engine(target_dir, hf_overrides={
        "sliding_window": 64, "layer_types": ["sliding_attention"] * layers},
        speculative_config={"method": "eagle3_tree", "model": str(random_drafter)})
    with pytest.raises(AssertionError, match="engine run 'sliding_window' failed"):
        run_engine({"engine": engine, "prompts": [[1, 2, 3]], "sampling": {"max_tokens": 2}},
                   engine_dir, "sliding_window")
    log = (engine_dir / "sliding_window.log").read_text()
    assert "eagle3_tree does not support sliding-window attention layers (window 64)" in log
    assert "Loading weights took" not in log


def test_a_drafter_for_another_model_fails_before_vllm_reads_it(target_dir, random_drafter,
                                                                tmp_path):
    import shutil

    from vllm_treespec.config import TreeSpecConfigError

    broken = shutil.copytree(random_drafter, tmp_path / "drafter")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(config, vocab_size=32000)))
    with pytest.raises(TreeSpecConfigError, match="vocab_size 32000 in config.json"):
        engine_config(target_dir, {"method": "eagle3_tree", "model": str(broken)})
    with pytest.raises(TreeSpecConfigError, match="'model' has invalid value '/no/such/dir'"):
        engine_config(target_dir, {"method": "eagle3_tree", "model": "/no/such/dir"})



def test_vllm_falls_back_to_its_v1_runner_for_trees(target_dir, random_drafter, monkeypatch):
    """Where vLLM would pick its V2 model runner (Triton present: a GPU, or a CPU
    with triton-cpu), a tree engine gets V1, which the tree runner is built on;
    forcing V2 is refused by name."""
    import vllm.config.vllm as vllm_config_module

    from vllm_treespec.config import TreeSpecConfigError

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    stock = engine_config(target_dir, {"method": "eagle3", "model": str(random_drafter),
                                       "num_speculative_tokens": 2})
    if not stock.use_v2_model_runner:
        pytest.skip("this vLLM does not default to its V2 runner for this model")
    tree = engine_config(target_dir, {"method": "eagle3_tree", "model": str(random_drafter)})
    assert not tree.use_v2_model_runner
    # Forced: vLLM's own validation names the method (ours, check_engine, backs it up).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises((TreeSpecConfigError, ValueError), match="eagle3_tree"):
        engine_config(target_dir, {"method": "eagle3_tree", "model": str(random_drafter)})


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 4096, "vocab_size": 49152,
    "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.mark.parametrize("parallel, needle", [
    ({"data_parallel_size": 2}, r"data parallelism of a mixture-of-experts target "
                                r"\(data_parallel_size 2, model_type 'qwen3_moe'\)"),
    ({"enable_expert_parallel": True}, r"expert parallelism \(enable_expert_parallel\)"),
], ids=["dp2", "ep"])
def test_a_moe_target_with_dp_or_ep_is_refused_before_anything_loads(target_dir, tmp_path,
                                                                     parallel, needle):
    """Qwen3-MoE's layout, from its config alone (docs/scale-out.md): vLLM steps a
    mixture-of-experts target's DP ranks in lock step, which tree steps do not keep.
    One replica of the same target passes the engine checks."""
    from vllm_treespec.config import TreeSpecConfigError

    moe, head = config_only_pair(target_dir, tmp_path, "qwen3-moe", QWEN3_MOE)
    spec = {"method": "eagle3_tree", "model": str(head)}
    with pytest.raises(TreeSpecConfigError, match=needle):
        engine_config(moe, spec, max_model_len=1024, **parallel)
    assert engine_config(moe, spec, max_model_len=1024).model_config.is_moe
