"""Setups the tree path would get wrong are refused, naming the feature."""

from __future__ import annotations

import pytest

from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import support

PLAIN_LAYER = dict(sliding_window=None, alibi_slopes=None, logits_soft_cap=None, sinks=None,
                   kv_cache_dtype="auto")


@pytest.mark.parametrize("found", ["0.27.1", "0.27.1+cpu", "0.27.1.post1"])
def test_the_supported_vllm_release_passes(found):
    support.check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.27.0", "0.270.1", "0.32.0", "garbage"])
def test_other_vllm_releases_are_refused_naming_both(found, monkeypatch):
    monkeypatch.delenv(support.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(TreeSpecConfigError) as err:
        support.check_vllm_version(found)
    assert repr(found) in str(err.value) and support.SUPPORTED_VLLM in str(err.value)
    assert support.ALLOW_UNTESTED_ENV in str(err.value)


def test_the_opt_out_lets_an_untested_release_through(monkeypatch):
    monkeypatch.setenv(support.ALLOW_UNTESTED_ENV, "1")
    support.check_vllm_version("0.32.0")


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
