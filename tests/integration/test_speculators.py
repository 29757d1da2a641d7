"""A speculators-format EAGLE-3 head served as the model, with trees.

``vllm serve HEAD --speculative-config '{"method": "eagle3_tree", ...}'`` (and
``LLM(HEAD, speculative_config=...)``, and the ``--spec-method`` flag): vLLM swaps
in the head's verifier as the model and, left alone, locks the method to the
head's own ``eagle3`` (0.32.0) or drops the user's config (0.27.1), so trees were
served as chains without a word. Here the tree method is kept with the head's
settings, or the engine is refused at startup, naming the key.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.integration.conftest import SHORT_GREEDY_TOKENS, base_engine, run_engine
from tests.integration.drafters import speculators_eagle3_drafter
from tests.integration.test_config_errors import engine_config

pytestmark = pytest.mark.vllm

# Not vLLM's defaults for a Llama target (2, L/2, L-3) and its speculators reader
# (norm_before_residual True), nor the tree's num_nodes: values that show where
# they came from.
AUX_LAYERS = (3, 11, 25)
CHAIN = 5


@pytest.fixture(scope="module")
def speculators_head(target_dir, tmp_path_factory):
    return speculators_eagle3_drafter(target_dir, tmp_path_factory.mktemp("speculators"),
                                      norm_before_residual=False, speculative_tokens=CHAIN,
                                      aux_layers=AUX_LAYERS)


def assert_tree_engine(cfg, target_dir, head, num_nodes):
    tree = cfg.additional_config.get("eagle3_tree") if cfg.additional_config else None
    assert tree is not None, (
        f"served as stock {cfg.speculative_config.method!r} chains of "
        f"{cfg.speculative_config.num_speculative_tokens}, not trees")
    assert tree["num_nodes"] == num_nodes
    assert cfg.speculative_config.num_speculative_tokens == num_nodes  # not the head's chain
    assert cfg.parallel_config.worker_cls.endswith("TreeCPUWorker")
    assert cfg.model_config.model == str(target_dir)  # the head's verifier
    draft = cfg.speculative_config.draft_model_config
    assert draft.model == str(head)
    # The head's settings reach the config vLLM's EAGLE-3 model reads.
    assert draft.hf_config.norm_before_residual is False
    assert list(draft.hf_config.eagle_aux_hidden_state_layer_ids) == list(AUX_LAYERS)
    assert draft.hf_config.draft_vocab_size == 4096


@pytest.mark.parametrize("form", ["json", "json_tree_keys", "flags"])
def test_the_tree_method_wins_over_the_heads_own(target_dir, speculators_head, form):
    from vllm.engine.arg_utils import EngineArgs

    if form == "flags":
        import vllm_treespec

        vllm_treespec.register()
        cfg = EngineArgs(model=str(speculators_head), spec_method="eagle3_tree"
                         ).create_engine_config()
        num_nodes = 32  # TreeSpecConfig's default
    else:
        spec = {"method": "eagle3_tree"}
        num_nodes = 32
        if form == "json_tree_keys":
            spec.update(num_nodes=8, depth=4, top_k=4)
            num_nodes = 8
        cfg = engine_config(speculators_head, spec)
    assert_tree_engine(cfg, target_dir, speculators_head, num_nodes)


def test_stock_eagle3_from_the_head_is_untouched(target_dir, speculators_head):
    cfg = engine_config(speculators_head, None)
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.speculative_config.num_speculative_tokens == CHAIN
    assert "eagle3_tree" not in (cfg.additional_config or {})


def test_another_drafter_named_beside_a_served_head_is_refused(speculators_head,
                                                               random_drafter):
    from vllm_treespec.config import TreeSpecConfigError

    with pytest.raises(TreeSpecConfigError, match=(
            r"speculative-config key 'model' has value '.*'; allowed: leave it out, or ")):
        engine_config(speculators_head, {"method": "eagle3_tree",
                                         "model": str(random_drafter)})


def test_a_speculators_head_of_another_kind_is_refused(target_dir, tmp_path):
    from vllm_treespec.config import TreeSpecConfigError

    head = speculators_eagle3_drafter(target_dir, tmp_path / "peagle")
    config = json.loads((head / "config.json").read_text())
    config.update(speculators_model_type="peagle", mask_token_id=0)
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(TreeSpecConfigError, match=(
            r"speculators_model_type has value 'peagle'; allowed: one of \['eagle3'\]")):
        engine_config(head, {"method": "eagle3_tree"})


def test_a_head_setting_lost_in_conversion_is_refused():
    """A vLLM whose speculators conversion dropped a setting would draft with
    another function than the head was trained for: refused, naming the key."""
    from vllm_treespec.config import TreeSpecConfigError
    from vllm_treespec.vllm_glue.speculators import check_head_config

    head = {"norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "target_hidden_size": None}
    kept = SimpleNamespace(norm_before_residual=True, eagle_aux_hidden_state_layer_ids=(1, 2, 3))
    check_head_config("HEAD", head, kept)
    del kept.norm_before_residual
    with pytest.raises(TreeSpecConfigError, match=(
            r"'HEAD': norm_before_residual has value True in its config.json, but vLLM's "
            r"converted draft config carries None")):
        check_head_config("HEAD", head, kept)


def test_a_served_speculators_head_drafts_trees_with_greedy_identity(
        target_dir, tmp_path, short_greedy_reference, engine_dir):
    """LLM(HEAD, speculative_config={"method": "eagle3_tree", ...}): trees are
    verified (a chain engine has no tree metrics), and greedy output is plain
    vLLM's on the head's verifier."""
    prompts, plain = short_greedy_reference
    # What published heads set (the fixture's head keeps vLLM's other residual path).
    head = speculators_eagle3_drafter(target_dir, tmp_path / "head", norm_before_residual=True,
                                      aux_layers=AUX_LAYERS)
    tree = {"method": "eagle3_tree", "num_nodes": 8, "depth": 4, "top_k": 4}
    out = run_engine({"engine": base_engine(head, speculative_config=tree),
                      "prompts": prompts,
                      "sampling": {"temperature": 0.0, "max_tokens": SHORT_GREEDY_TOKENS}},
                     engine_dir, "speculators_head_tree")
    # Adaptive (the default): a fresh budget drafts before the random head's
    # misses turn it off (test_parallel_drafting's adaptive run counts on it too).
    assert out["tree"]["trees"] > 0, out["tree"]
    expected = [o[0] for o in plain["outputs"]]
    bad = [i for i, (o, e) in enumerate(zip(out["outputs"], expected)) if o[0] != e]
    assert not bad, f"prompts {bad} differ from plain decoding"
