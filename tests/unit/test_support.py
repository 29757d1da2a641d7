"""Setups the tree path would get wrong are refused, naming the feature."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import support, versions

PLAIN_LAYER = dict(sliding_window=None, alibi_slopes=None, logits_soft_cap=None, sinks=None,
                   kv_cache_dtype="auto")


@pytest.mark.parametrize("found", ["0.27.1", "0.27.1+cpu", "0.27.1.post1", "0.32.0",
                                   "0.32.0+cpu"])
def test_the_supported_vllm_releases_pass(found, monkeypatch):
    monkeypatch.delenv(support.ALLOW_UNTESTED_ENV, raising=False)
    support.check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.27.0", "0.270.1", "0.31.1", "0.33.0", "garbage"])
def test_other_vllm_releases_are_refused_naming_the_supported_ones(found, monkeypatch):
    monkeypatch.delenv(support.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_vllm_version(found)
    assert repr(found) in str(err.value)
    assert all(v in str(err.value) for v in versions.SUPPORTED), err.value
    assert support.ALLOW_UNTESTED_ENV in str(err.value)


def test_the_opt_out_lets_an_untested_release_through(monkeypatch):
    monkeypatch.setenv(support.ALLOW_UNTESTED_ENV, "1")
    support.check_vllm_version("0.33.0")


def test_the_ascend_pairing_the_glue_was_mapped_on_passes(monkeypatch):
    monkeypatch.delenv(support.ALLOW_UNTESTED_ENV, raising=False)
    support.check_ascend_pairing("0.27.1", "0.23.1.dev412+g182b75ea8", "2.10.0.post4")
    support.check_ascend_pairing("0.27.1", "0.23.1.dev412+g182b75e.d20260901",
                                 "2.10.0.post4+git1234")


@pytest.mark.parametrize("vllm_release, vllm_ascend, torch_npu", [
    ("0.32.0", "0.32.0rc1", "2.10.0.post4"),               # no pairing mapped for 0.32.0
    ("0.27.1", "0.23.0.post1", "2.10.0.post4"),           # the registry's release
    ("0.27.1", "0.23.1.dev9+gdeadbee", "2.10.0.post4"),   # another commit of main
    ("0.27.1", None, "2.10.0.post4"),                     # not installed
    ("0.27.1", "0.23.1.dev412+g182b75ea8", "2.14.0"),     # another torch_npu
])
def test_other_ascend_pairings_are_refused_naming_found_and_supported(
        vllm_release, vllm_ascend, torch_npu, monkeypatch):
    monkeypatch.delenv(support.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_ascend_pairing(vllm_release, vllm_ascend, torch_npu)
    msg = str(err.value)
    assert f"vLLM {vllm_release}, vllm-ascend {vllm_ascend!r}, torch_npu {torch_npu!r}" in msg
    assert "vllm-ascend 182b75e" in msg and "torch_npu 2.10.0.post4" in msg, msg
    monkeypatch.setenv(support.ALLOW_UNTESTED_ENV, "1")
    support.check_ascend_pairing(vllm_release, vllm_ascend, torch_npu)


def test_a_plain_attention_layer_passes():
    support.check_attention_layer(**PLAIN_LAYER)
    support.check_attention_layer(**dict(PLAIN_LAYER, sliding_window=-1))  # vLLM's "none"


@pytest.mark.parametrize("feature, needle", [
    ({"sliding_window": 4096}, "sliding-window attention layers (window 4096)"),
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi attention"),
    ({"logits_soft_cap": 50.0}, "attention logit soft-capping (cap 50.0)"),
    ({"sinks": object()}, "attention sinks"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
])
def test_layer_features_trees_ignore_are_refused(feature, needle):
    with pytest.raises(TreeSpecConfigError, match="eagle3_tree does not support") as err:
        support.check_attention_layer(**dict(PLAIN_LAYER, **feature))
    assert needle in str(err.value)


def test_more_than_one_kv_cache_group_is_refused():
    support.check_kv_cache_groups(1)
    with pytest.raises(TreeSpecConfigError, match="2 KV-cache groups"):
        support.check_kv_cache_groups(2)


# --- the drafter checkpoint, checked against the target before vLLM reads it ---

SMOLLM2_TARGET = SimpleNamespace(hidden_size=576, num_hidden_layers=30, vocab_size=49152)
SHIPPED = Path(__file__).resolve().parents[2] / "vllm_treespec/drafters/smollm2-135m-eagle3"


@pytest.fixture
def drafter_copy(tmp_path) -> Path:
    out = tmp_path / "drafter"
    shutil.copytree(SHIPPED, out)
    return out


def _edit_config(drafter: Path, **changes) -> None:
    config = json.loads((drafter / "config.json").read_text())
    config.update(changes)
    (drafter / "config.json").write_text(json.dumps(config))


def test_the_shipped_drafter_fits_its_target():
    support.check_drafter(str(SHIPPED), SMOLLM2_TARGET)


def test_a_hub_id_is_not_read_from_disk_when_the_speculative_config_is_made():
    """Its config is checked once vLLM has resolved it (``test_glue_checks``, hub heads)."""
    support.check_drafter("someone/some-eagle3-head", SMOLLM2_TARGET)


@pytest.mark.parametrize("model", ["/no/such/drafter", "./no-such-drafter", "~/no-such-drafter"])
def test_a_missing_drafter_path_is_refused_naming_the_key(model):
    with pytest.raises(TreeSpecConfigError, match=f"'model' has invalid value '{re.escape(model)}'"):
        support.check_drafter(model, SMOLLM2_TARGET)


@pytest.mark.parametrize("changes, needle", [
    ({"target_hidden_size": 960}, "hidden states of size 960"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 31]}},
     "eagle_aux_hidden_state_layer_ids [2, 15, 31]"),
    ({"vocab_size": 32000}, "vocab_size 32000"),
])
def test_a_drafter_for_another_target_is_refused(drafter_copy, changes, needle):
    _edit_config(drafter_copy, **changes)
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    assert needle in str(err.value) and str(drafter_copy) in str(err.value)


def test_a_truncated_checkpoint_is_refused_naming_the_file(drafter_copy):
    weights = drafter_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(TreeSpecConfigError, match="model.safetensors.*not a readable"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_weights_shaped_for_another_target_are_refused(drafter_copy):
    # config.json says 576 but the fc layer was trained on 3 x 960 inputs
    from safetensors.torch import load_file, save_file

    weights = load_file(drafter_copy / "model.safetensors")
    weights["fc.weight"] = torch.zeros(576, 3 * 960)
    save_file(weights, drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match=r"fc.weight has shape \[576, 2880\]"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_draft_vocabulary_map_beyond_the_target_is_refused(drafter_copy):
    from safetensors.torch import load_file, save_file

    weights = load_file(drafter_copy / "model.safetensors")
    weights["d2t"][-1] += SMOLLM2_TARGET.vocab_size  # maps the last draft token past the end
    save_file(weights, drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match="d2t maps draft tokens to target ids"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_draft_vocabulary_map_that_merges_two_draft_tokens_is_refused(drafter_copy):
    """Two draft tokens of one target token would be two siblings with one token:
    refused naming both and the target token (used to pass: only the range was
    checked)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(drafter_copy / "model.safetensors")
    d2t = weights["d2t"]
    target = int(d2t[3]) + 3
    d2t[7] = target - 7  # draft token 7 now maps where draft token 3 does
    save_file(weights, drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match=rf"d2t maps draft tokens \[3, 7\] all to "
                                                  rf"target token {target} .*injective"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_the_loaded_vocabulary_map_of_a_hub_drafter_is_checked_too(monkeypatch):
    """A hub drafter's files are vLLM's to fetch: its map is checked once loaded."""
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    monkeypatch.setattr(EagleProposer, "load_model", lambda self, *a, **k: None)
    proposer = TreeEagleProposer.__new__(TreeEagleProposer)
    proposer.tree_cfg, proposer.grammars = SimpleNamespace(draft="sequential"), None
    proposer.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 100),
        speculative_config=SimpleNamespace(model="someone/some-eagle3-head"))
    proposer.model = SimpleNamespace(draft_id_to_target_id=torch.tensor([5, 4, 10]))
    with pytest.raises(TreeSpecConfigError, match=r"'someone/some-eagle3-head'.*draft tokens "
                                                  r"\[0, 1\] all to target token 5"):
        proposer.load_model()
    proposer.model = SimpleNamespace(draft_id_to_target_id=torch.tensor([5, 5, 10]))
    proposer._token_map_cache = None  # a fresh load
    proposer.load_model()  # 5, 6, 12: injective


def test_parallel_drafting_needs_a_head_trained_for_it(drafter_copy):
    """"draft": "parallel": pard_token in config.json, mask_hidden in the weights
    (sized like fc's input), and at least as many trained slots as the depth."""
    from safetensors.torch import load_file, save_file

    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)  # fine sequentially
    with pytest.raises(TreeSpecConfigError, match="no integer 'pard_token'.*--parallel K"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=4)
    _edit_config(drafter_copy, pard_token=0, parallel_drafting_slots=4)
    with pytest.raises(TreeSpecConfigError, match="no 'mask_hidden' tensor"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=4)
    weights = load_file(drafter_copy / "model.safetensors")
    weights["mask_hidden"] = torch.zeros(1, 3 * 576)
    save_file(weights, drafter_copy / "model.safetensors")
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=4)
    with pytest.raises(TreeSpecConfigError,
                       match=r"key 'depth' has invalid value 5; allowed: an integer in \[1, 4\]"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=5)
    weights["mask_hidden"] = torch.zeros(1, 576)
    save_file(weights, drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match=r"mask_hidden has shape \[1, 576\]"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=4)


def _as_speculators(drafter: Path, algorithm: str = "eagle3", **top) -> None:
    """Rewrite the drafter's config.json in the speculators format (RedHatAI's
    ``*-speculator.eagle3`` heads): the layer's fields under
    ``transformer_layer_config``, the algorithm's at the top."""
    config = json.loads((drafter / "config.json").read_text())
    eagle = config.pop("eagle_config")
    top = dict(draft_vocab_size=config.pop("draft_vocab_size"),
               target_hidden_size=config.pop("target_hidden_size"),
               eagle_aux_hidden_state_layer_ids=eagle["eagle_aux_hidden_state_layer_ids"],
               **top)
    if "pard_token" in config:
        top.setdefault("mask_token_id", config.pop("pard_token"))
    config.pop("architectures")
    (drafter / "config.json").write_text(json.dumps(dict(
        architectures=["Eagle3Speculator"], speculators_model_type=algorithm,
        speculators_config={"algorithm": algorithm, "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}},
        transformer_layer_config=config, **top)))


def test_a_speculators_format_config_is_read_as_vllm_converts_it(drafter_copy):
    _as_speculators(drafter_copy)
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    config = json.loads((drafter_copy / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 32000  # a mismatch there is caught
    (drafter_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(TreeSpecConfigError, match="vocab_size 32000"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_speculators_parallel_head_names_its_token_mask_token_id(tmp_path):
    """vLLM's converter maps a peagle head's mask_token_id to pard_token (refused
    before: pard_token was read from the raw config.json only)."""
    drafter = tmp_path / "peagle"
    shutil.copytree(SHIPPED.parent / "smollm2-135m-peagle4", drafter)
    _as_speculators(drafter, "peagle")
    assert "mask_token_id" in json.loads((drafter / "config.json").read_text())
    support.check_drafter(str(drafter), SMOLLM2_TARGET, parallel_depth=4)
    config = json.loads((drafter / "config.json").read_text())
    del config["mask_token_id"]
    config["speculators_model_type"] = "eagle3"
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(TreeSpecConfigError,
                       match=r"no integer 'pard_token' \(speculators format: 'mask_token_id'\)"):
        support.check_drafter(str(drafter), SMOLLM2_TARGET, parallel_depth=4)


def _edit_weights(drafter: Path, **changes) -> None:
    """Replace (a tensor) or drop (None) tensors of the drafter's weights."""
    from safetensors.torch import load_file, save_file

    weights = load_file(drafter / "model.safetensors")
    for key, value in changes.items():
        if value is None:
            del weights[key]
        else:
            weights[key] = value
    save_file(weights, drafter / "model.safetensors")


def test_a_head_whose_fc_takes_four_auxiliary_layers_fits(drafter_copy):
    """vLLM sizes fc for len(eagle_aux_hidden_state_layer_ids) target hidden states
    (refused before: fc had to take exactly 3)."""
    from safetensors.torch import load_file, save_file

    _edit_config(drafter_copy, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 10, 20, 27],
                                             "use_aux_hidden_state": True},
                 pard_token=0)
    _edit_weights(drafter_copy, **{"fc.weight": torch.zeros(576, 4 * 576),
                                   "mask_hidden": torch.zeros(1, 4 * 576)})
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=3)
    weights = load_file(drafter_copy / "model.safetensors")
    save_file(dict(weights, **{"fc.weight": torch.zeros(576, 3 * 576)}),
              drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match=r"fc.weight has shape \[576, 1728\]; .* needs "
                                                  r"2304 inputs \(4 auxiliary layers x target "
                                                  r"hidden size 576\)"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    save_file(dict(weights, mask_hidden=torch.zeros(1, 3 * 576)),
              drafter_copy / "model.safetensors")
    with pytest.raises(TreeSpecConfigError, match=r"mask_hidden has shape \[1, 1728\]; .* "
                                                  r"needs 2304 values"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET, parallel_depth=3)


@pytest.mark.parametrize("changes", [
    {"num_aux_hidden_states": 4},                   # vLLM's llama_eagle3 reads the count
    {"architectures": ["Eagle3Qwen3ForCausalLM"]},  # its qwen3_eagle3 counts top-level ids
])
def test_top_level_aux_layer_ids_fit_where_vllm_sizes_fc_for_them(drafter_copy, changes):
    config = json.loads((drafter_copy / "config.json").read_text())
    del config["eagle_config"]
    config.update(eagle_aux_hidden_state_layer_ids=[2, 10, 20, 27], **changes)
    (drafter_copy / "config.json").write_text(json.dumps(config))
    _edit_weights(drafter_copy, **{"fc.weight": torch.zeros(576, 4 * 576)})
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_top_level_aux_layer_ids_vllm_would_size_fc_without_are_refused(drafter_copy):
    """The target would send 4 hidden states to an fc vLLM's Eagle3LlamaForCausalLM
    builds for 3 (it counts eagle_config's ids only): a shape error mid-load before."""
    config = json.loads((drafter_copy / "config.json").read_text())
    del config["eagle_config"]
    config["eagle_aux_hidden_state_layer_ids"] = [2, 10, 20, 27]
    (drafter_copy / "config.json").write_text(json.dumps(config))
    _edit_weights(drafter_copy, **{"fc.weight": torch.zeros(576, 4 * 576)})
    with pytest.raises(TreeSpecConfigError, match=r"eagle_aux_hidden_state_layer_ids \[2, 10, 20, "
                                                  r"27\] .* sends 4 hidden states, but vLLM's "
                                                  r"LlamaForCausalLMEagle3 sizes fc for 3 .*"
                                                  r"allowed: num_aux_hidden_states 4"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_repeated_aux_layer_id_is_refused_before_it_fails_every_drafting_step(drafter_copy):
    """vLLM's target appends each layer's state once: ids [2, 2, 15] send 2 states to
    an fc built for 3, and every drafting step failed with a shape error."""
    _edit_config(drafter_copy, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 2, 15],
                                             "use_aux_hidden_state": True})
    with pytest.raises(TreeSpecConfigError, match=r"\[2, 2, 15\] in config.json: the target "
                                                  r"sends 2 hidden states, but vLLM's "
                                                  r"LlamaForCausalLMEagle3 sizes fc for 3"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_head_narrower_than_its_target_is_sized_by_target_hidden_size(drafter_copy):
    """fc takes target_hidden_size-wide states and gives the head's own width."""
    _edit_config(drafter_copy, hidden_size=64, target_hidden_size=576)
    _edit_weights(drafter_copy, **{"fc.weight": torch.zeros(64, 3 * 576)})
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    _edit_weights(drafter_copy, **{"fc.weight": torch.zeros(64, 3 * 64)})
    with pytest.raises(TreeSpecConfigError, match=r"needs 1728 inputs \(3 auxiliary layers x "
                                                  r"target hidden size 576\)"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    _edit_config(drafter_copy, target_hidden_size=960)
    with pytest.raises(TreeSpecConfigError, match=r"config.json target_hidden_size 960\); "
                                                  r"allowed: the target's hidden_size 576"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


@pytest.mark.parametrize("draft_vocab", [{"draft_vocab_size": 49152}, {"draft_vocab_size": None}])
def test_a_full_vocabulary_head_without_d2t_fits(drafter_copy, draft_vocab):
    _edit_config(drafter_copy, **draft_vocab)  # None: vLLM's default, the head's vocab_size
    _edit_weights(drafter_copy, d2t=None, t2d=None,
                  **{"lm_head.weight": torch.zeros(49152, 576)})
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_reduced_vocabulary_head_without_d2t_is_refused(drafter_copy):
    """vLLM would keep its all-zero map: draft token i drafts target token i, the
    first 8192 tokens only, which the injectivity check passes (served silently
    before)."""
    _edit_weights(drafter_copy, d2t=None)
    with pytest.raises(TreeSpecConfigError, match=r"draft_vocab_size 8192 in config.json, the "
                                                  r"target's vocab_size 49152, and no 'd2t' "
                                                  r"tensor .*allowed: a d2t map"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_draft_vocabulary_map_of_another_length_is_refused(drafter_copy):
    _edit_weights(drafter_copy, d2t=torch.zeros(4096, dtype=torch.long))
    with pytest.raises(TreeSpecConfigError, match=r"d2t has 4096 entries; allowed: 8192"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def _as_bin(drafter: Path, name: str = "pytorch_model.bin") -> Path:
    """The original EAGLE-3 releases' layout: one pytorch_model.bin, no safetensors."""
    from safetensors.torch import load_file

    weights = load_file(drafter / "model.safetensors")
    (drafter / "model.safetensors").unlink()
    torch.save(weights, drafter / name)
    torch.save({"not": "weights"}, drafter / "training_args.bin")  # skipped, as vLLM does
    return drafter / name


def test_a_bin_only_checkpoint_gets_the_same_weight_checks(drafter_copy):
    """fc, d2t and mask_hidden of a .bin checkpoint are checked (skipped before)."""
    from safetensors.torch import load_file

    weights = load_file(drafter_copy / "model.safetensors")
    file = _as_bin(drafter_copy)
    support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    for changes, needle in [
        ({"fc.weight": torch.zeros(576, 3 * 960)}, r"fc.weight has shape \[576, 2880\]"),
        ({"d2t": torch.zeros(8192, dtype=torch.long).index_fill_(0, torch.tensor([7]), -4)},
         r"d2t maps draft tokens \[3, 7\] all to target token 3"),
    ]:
        torch.save(dict(weights, **changes), file)
        with pytest.raises(TreeSpecConfigError, match=rf"pytorch_model.bin'.*{needle}"):
            support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    torch.save({k: v for k, v in weights.items() if k != "d2t"}, file)
    with pytest.raises(TreeSpecConfigError, match="no 'd2t' tensor"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)
    torch.save(weights, file)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(TreeSpecConfigError, match="pytorch_model.bin.*not a readable PyTorch"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


def test_a_bin_checkpoint_that_would_run_code_on_load_is_refused(drafter_copy):
    file = _as_bin(drafter_copy)
    torch.save({"fc.weight": torch.zeros(576, 1728), "hook": SimpleNamespace()}, file)
    with pytest.raises(TreeSpecConfigError, match="pytorch_model.bin.*not a readable PyTorch"):
        support.check_drafter(str(drafter_copy), SMOLLM2_TARGET)


# --- a head named by hub id: checked on the config vLLM resolves, before weights load ---

def _hub_engine(drafter: Path, draft: str = "sequential", depth: int = 4):
    """(engine config, tree config) as ``create_engine_config`` hands them to the
    check for a head named by hub id: the draft hf_config built as vLLM builds it
    (``get_config``; an eagle3 head not in the speculators format is wrapped in
    ``EAGLEConfig``, as ``SpeculativeConfig`` does), from ``drafter``'s config.json."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    from vllm_treespec.config import TreeSpecConfig

    hf_config = get_config(str(drafter), trust_remote_code=False)
    if not isinstance(hf_config, SpeculatorsConfig):
        hf_config = EAGLEConfig(hf_config, method="eagle3", model_type="eagle")
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(
        model="someone/smollm2-eagle3-head", hf_config=hf_config))
    engine = SimpleNamespace(speculative_config=spec,
                             model_config=SimpleNamespace(hf_text_config=SMOLLM2_TARGET))
    return engine, TreeSpecConfig.from_dict({"draft": draft, "depth": depth})


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_a_hub_head_that_fits_its_target_passes(drafter_copy, layout):
    from vllm_treespec.vllm_glue.spec_config import check_resolved_drafter

    if layout == "speculators":
        _as_speculators(drafter_copy)
    check_resolved_drafter(*_hub_engine(drafter_copy))


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("changes, needle", [
    # a head for SmolLM2-360M (hidden 960, 15 heads)
    ({"target_hidden_size": 960, "hidden_size": 960, "num_attention_heads": 15,
      "num_key_value_heads": 5},
     "hidden states of size 960 (config.json target_hidden_size 960); allowed: the "
     "target's hidden_size 576"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 15, 31]},
     "eagle_aux_hidden_state_layer_ids [2, 15, 31] in config.json; the target has layers 0..29"),
    ({"vocab_size": 32000}, "vocab_size 32000 in config.json; the target's vocab_size is 49152"),
])
def test_a_hub_head_for_another_target_is_refused_before_weights_load(drafter_copy, layout,
                                                                      changes, needle):
    """A hub id used to get no checks before loading: a head for another target with
    matching tensor shapes loaded and drafted garbage."""
    from vllm_treespec.vllm_glue.spec_config import check_resolved_drafter

    config = json.loads((drafter_copy / "config.json").read_text())
    if "eagle_aux_hidden_state_layer_ids" in changes:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = \
            changes["eagle_aux_hidden_state_layer_ids"]
    else:
        config.update(changes)
    (drafter_copy / "config.json").write_text(json.dumps(config))
    if layout == "speculators":
        _as_speculators(drafter_copy)
    with pytest.raises(TreeSpecConfigError) as err:
        check_resolved_drafter(*_hub_engine(drafter_copy))
    assert needle in str(err.value) and "'someone/smollm2-eagle3-head'" in str(err.value), \
        err.value


def test_a_hub_parallel_head_is_checked_for_its_token_and_slots(tmp_path):
    from vllm_treespec.vllm_glue.spec_config import check_resolved_drafter

    drafter = tmp_path / "peagle"
    shutil.copytree(SHIPPED.parent / "smollm2-135m-peagle4", drafter)
    check_resolved_drafter(*_hub_engine(drafter, "parallel", depth=4))
    with pytest.raises(TreeSpecConfigError, match=r"'depth' has invalid value 5; allowed: an "
                                                  r"integer in \[1, 4\]"):
        check_resolved_drafter(*_hub_engine(drafter, "parallel", depth=5))
    _as_speculators(drafter, "peagle")  # mask_token_id, which vLLM maps to pard_token
    check_resolved_drafter(*_hub_engine(drafter, "parallel", depth=4))
    with pytest.raises(TreeSpecConfigError, match="no integer 'pard_token'"):
        check_resolved_drafter(*_hub_engine(SHIPPED, "parallel", depth=4))


def test_every_layer_must_run_the_tree_backend():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from vllm_treespec.vllm_glue.cpu_attention import TreeCPUAttentionBackend

    support.check_tree_backends([TreeCPUAttentionBackend] * 3, TreeCPUAttentionBackend)
    # the registry override did not take for one layer: stock attention, causal for trees
    with pytest.raises(TreeSpecConfigError, match="CPUAttentionBackend.*causal"):
        support.check_tree_backends([TreeCPUAttentionBackend, CPUAttentionBackend],
                                    TreeCPUAttentionBackend)


def test_a_node_budget_must_fit_one_step_of_tokens():
    support.check_token_budget(47, 48)
    with pytest.raises(TreeSpecConfigError, match="'num_nodes' has invalid value 48; "
                                                  "allowed: 1..47"):
        support.check_token_budget(48, 48)


def test_a_platform_without_a_tree_worker_is_refused():
    from vllm_treespec.vllm_glue.spec_config import _select_worker

    with pytest.raises(TreeSpecConfigError, match="platform 'rocm' is not supported"):
        _select_worker(SimpleNamespace(worker_cls="auto"), kind="rocm", environ={})
    chosen = SimpleNamespace(worker_cls="auto")
    _select_worker(chosen, kind="cpu", environ={})
    assert chosen.worker_cls.endswith("TreeCPUWorker")


@pytest.mark.parametrize("name", ["VLLM_TREESPEC_ASCEND_VARIANT",
                                  "VLLM_TREESPEC_ASCEND_FULL_GRAPH"])
def test_ascend_tree_attention_asked_for_without_torch_npu_is_refused(name):
    from vllm_treespec.vllm_glue.spec_config import _select_worker

    with pytest.raises(TreeSpecConfigError, match=rf"\${name}=.* asks for Ascend tree "
                                                  rf"attention, but vLLM runs on platform 'cpu'"):
        _select_worker(SimpleNamespace(worker_cls="auto"), kind="cpu",
                       environ={name: "two_pass" if "VARIANT" in name else "1"})
    npu = SimpleNamespace(worker_cls="auto")
    _select_worker(npu, kind="npu", environ={name: "1"})  # where it means something
    assert npu.worker_cls.endswith("TreeNPUWorker")


def test_ascend_settings_at_their_defaults_pass_anywhere():
    from vllm_treespec.vllm_glue.spec_config import _select_worker

    _select_worker(SimpleNamespace(worker_cls="auto"), kind="cpu",
                   environ={"VLLM_TREESPEC_ASCEND_VARIANT": "full_mask",
                            "VLLM_TREESPEC_ASCEND_FULL_GRAPH": "0"})


def test_pipeline_parallelism_is_refused():
    """vLLM refuses PP for this test model before a tree is checked, so the refusal
    is tested on the engine config check itself."""
    from vllm_treespec.config import TreeSpecConfigError
    from vllm_treespec.vllm_glue.support import check_engine

    def config(stages):
        return SimpleNamespace(
            model_config=SimpleNamespace(uses_mrope=False, uses_xdrope_dim=False,
                                         is_hybrid=False, is_attention_free=False,
                                         logits_processors=None),
            cache_config=SimpleNamespace(kv_offloading_size=None), kv_transfer_config=None,
            parallel_config=SimpleNamespace(pipeline_parallel_size=stages),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=2048))

    check_engine(config(1), num_nodes=8)
    with pytest.raises(TreeSpecConfigError, match="pipeline parallelism"):
        check_engine(config(2), num_nodes=8)


def _parallel_engine(moe: bool = False, **parallel):
    fields = dict(pipeline_parallel_size=1, tensor_parallel_size=2, data_parallel_size=1,
                  enable_expert_parallel=False, decode_context_parallel_size=1,
                  prefill_context_parallel_size=1)
    draft_tp = parallel.pop("draft_tensor_parallel_size", 2)
    return SimpleNamespace(parallel_config=SimpleNamespace(**dict(fields, **parallel)),
                           model_config=SimpleNamespace(
                               is_moe=moe, hf_config=SimpleNamespace(
                                   model_type="qwen3_moe" if moe else "llama")),
                           speculative_config=SimpleNamespace(
                               draft_tensor_parallel_size=draft_tp))


def test_tensor_and_dense_data_parallelism_are_served():
    support.check_parallelism(_parallel_engine())
    support.check_parallelism(_parallel_engine(tensor_parallel_size=1,
                                               draft_tensor_parallel_size=1))
    support.check_parallelism(_parallel_engine(data_parallel_size=2))


def test_data_parallelism_of_a_moe_target_is_refused_by_name():
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_parallelism(_parallel_engine(moe=True, data_parallel_size=2))
    assert ("data parallelism of a mixture-of-experts target (data_parallel_size 2, "
            "model_type 'qwen3_moe')") in str(err.value), err.value
    support.check_parallelism(_parallel_engine(moe=True))  # one replica: served


@pytest.mark.parametrize("parallel, needle", [
    ({"enable_expert_parallel": True}, "expert parallelism (enable_expert_parallel)"),
    ({"decode_context_parallel_size": 2},
     "context parallelism (decode_context_parallel_size 2)"),
    ({"prefill_context_parallel_size": 2},
     "context parallelism (prefill_context_parallel_size 2)"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism (pipeline_parallel_size 2)"),
    ({"draft_tensor_parallel_size": 1},
     "'draft_tensor_parallel_size' has invalid value 1; allowed: 2"),
])
def test_parallelism_the_tree_path_cannot_serve_is_refused_by_name(parallel, needle):
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_parallelism(_parallel_engine(**parallel))
    assert needle in str(err.value), err.value
