"""TreeSpecConfig: defaults, static trees, and one clear error per bad value."""

import pytest

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError


def test_defaults_are_valid_and_round_trip():
    cfg = TreeSpecConfig.from_dict({})
    assert (cfg.num_nodes, cfg.depth, cfg.top_k) == (32, 6, 8)
    assert cfg.tree_size == 33 and not cfg.is_static
    assert TreeSpecConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("raw, key, value, allowed", [
    ({"num_nodes": 0}, "num_nodes", "0", "[1, 256]"),
    ({"num_nodes": 257}, "num_nodes", "257", "[1, 256]"),
    ({"num_nodes": "16"}, "num_nodes", "'16'", "an integer"),
    ({"depth": 0}, "depth", "0", "[1, 32]"),
    ({"depth": True}, "depth", "True", "an integer"),
    ({"depth": 2.5}, "depth", "2.5", "an integer"),
    ({"depth": 10, "num_nodes": 4, "top_k": 2}, "depth", "10", "[1, num_nodes=4]"),
    ({"top_k": 0}, "top_k", "0", "[1, 64]"),
    ({"top_k": 65}, "top_k", "65", "[1, 64]"),
    ({"num_nodes": 64, "depth": 1, "top_k": 8}, "num_nodes", "64", "at most 8 candidates"),
    ({"exec_mode": "fast"}, "exec_mode", "'fast'", "'reference' or 'fused'"),
    ({"validate_invariants": "yes"}, "validate_invariants", "'yes'", "true or false"),
    ({"draft": "medusa"}, "draft", "'medusa'", "'sequential' or 'parallel'"),
    ({"draft": "parallel", "choices": [[0], [1]]}, "draft", "'parallel'", "'sequential' with 'choices'"),
    ({"choices": []}, "choices", "[]", "non-empty list"),
    ({"choices": [[0], [1, 0]]}, "choices[1]", "[1, 0]", "parent path [1]"),
    ({"choices": [[0], [0]]}, "choices[1]", "[0]", "each path at most once"),
    ({"choices": [[0], [-1]]}, "choices[1]", "[-1]", "child ranks"),
    ({"choices": [[0], [0, 1]], "num_nodes": 5}, "num_nodes", "5", "implied by 'choices'"),
    ({"choices": [[0], [0, 0]], "depth": 3}, "depth", "3", "implied by 'choices'"),
    ({"choices": [[0], [3]], "top_k": 2}, "top_k", "2", "[4, 64]"),
    ({"depth_weight": 0.1}, "depth_weight", "0.1", "[0.25, 4.0]"),
    ({"depth_weight": 5}, "depth_weight", "5", "[0.25, 4.0]"),
    ({"depth_weight": float("nan")}, "depth_weight", "nan", "[0.25, 4.0]"),
    ({"depth_weight": True}, "depth_weight", "True", "a number"),
    ({"depth_weight": "1.2"}, "depth_weight", "'1.2'", "a number"),
    ({"choices": [[0], [0, 0]], "depth_weight": 1.2}, "depth_weight", "1.2", "1 with 'choices'"),
    ({"cross_request_tokens": 64, "cross_request_unsalted": "yes"}, "cross_request_unsalted",
     "'yes'", "true or false"),
    ({"cross_request_tokens": 64, "cross_request_unsalted": 1}, "cross_request_unsalted",
     "1", "true or false"),
    ({"cross_request_unsalted": True}, "cross_request_unsalted", "True",
     "false with cross_request_tokens 0"),
])
def test_each_bad_value_names_key_value_and_range(raw, key, value, allowed):
    with pytest.raises(TreeSpecConfigError) as err:
        TreeSpecConfig.from_dict(raw)
    msg = str(err.value)
    assert f"key {key!r}" in msg and f"value {value}" in msg and allowed in msg, msg


def test_unknown_keys_are_errors():
    with pytest.raises(TreeSpecConfigError, match=r"unknown .*\['nodes'\].*num_nodes"):
        TreeSpecConfig.from_dict({"nodes": 8})


def test_static_choices_imply_size_depth_and_width():
    cfg = TreeSpecConfig.from_dict({"choices": [[0], [1], [0, 0], [0, 2]]})
    assert cfg.is_static and cfg.num_nodes == 4 and cfg.depth == 2
    assert cfg.top_k == 3 and cfg.max_children == 3
    assert cfg.choices == ((0,), (1,), (0, 0), (0, 2))


def test_direct_construction_is_validated_too():
    with pytest.raises(TreeSpecConfigError, match="'top_k'"):
        TreeSpecConfig(top_k=-1)


def test_the_engine_config_is_parsed_once_per_process_and_shared():
    from types import SimpleNamespace

    from vllm_treespec.vllm_glue.spec_config import ADDITIONAL_CONFIG_KEY, tree_config_from_vllm

    def engine(**tree):
        return SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: dict(tree)})

    first = tree_config_from_vllm(engine(num_nodes=12, depth=4))
    assert tree_config_from_vllm(engine(depth=4, num_nodes=12)) is first
    assert tree_config_from_vllm(engine(num_nodes=8)) is not first
    assert tree_config_from_vllm(engine(num_nodes=8)).num_nodes == 8
    assert tree_config_from_vllm(SimpleNamespace(additional_config={})) is None


def test_unsalted_requests_share_only_when_asked():
    assert TreeSpecConfig.from_dict({"cross_request_tokens": 64}).cross_request_unsalted is False
    cfg = TreeSpecConfig.from_dict({"cross_request_tokens": 64, "cross_request_unsalted": True})
    assert cfg.cross_request_unsalted and TreeSpecConfig.from_dict(cfg.to_dict()) == cfg
