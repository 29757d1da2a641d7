"""Padded attention heads compute exactly the original model's function."""

from __future__ import annotations

import pytest
import torch

from vllm_treespec.head_padding import pad_attention, padded_heads


def test_padded_head_counts_keep_the_group_and_divide():
    assert padded_heads(9, 3, 2) == (12, 4)  # SmolLM2-135M at TP 2
    assert padded_heads(9, 3, 4) == (12, 4)
    assert padded_heads(8, 2, 2) == (8, 2)   # already divisible: unchanged
    assert padded_heads(6, 3, 4) == (8, 4)
    for q, kv, m in [(9, 3, 2), (6, 3, 4), (14, 2, 4), (5, 5, 2)]:
        nq, nkv = padded_heads(q, kv, m)
        assert nq % m == 0 and nkv % m == 0 and nq // nkv == q // kv and nq >= q


def _tiny_llama(heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=16,
                         max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float().eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _padded_model(model, state, config):
    from transformers import LlamaConfig, LlamaForCausalLM

    padded = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    padded.load_state_dict(state, strict=False)
    padded.tie_weights()
    return padded


@pytest.mark.parametrize("multiple", [2, 4])
def test_a_padded_llama_gives_the_same_logits_exactly(multiple):
    model = _tiny_llama(3, 1)
    heads = padded_heads(3, 1, multiple)
    state, config = pad_attention(model.state_dict(), model.config.to_dict(), *heads)
    padded = _padded_model(model, state, config)
    assert padded.config.num_attention_heads == heads[0]
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(padded, ids), _logits(model, ids))


def test_the_comparison_fails_when_a_new_head_reaches_the_output():
    """Negative control: the new heads' o_proj columns must be zero."""
    model = _tiny_llama(3, 1)
    state, config = pad_attention(model.state_dict(), model.config.to_dict(), 6, 2)
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = state[name].clone()
    state[name][:, -16:] = 0.1
    # and the new KV head sees something, so its output is not zero
    k = "model.layers.0.self_attn.v_proj.weight"
    state[k] = state[k].clone()
    state[k][-16:] = 0.1
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    assert not torch.equal(_logits(_padded_model(model, state, config), ids),
                           _logits(model, ids))


def test_padding_refuses_to_change_the_group_size():
    model = _tiny_llama(3, 1)
    with pytest.raises(ValueError, match="group size"):
        pad_attention(model.state_dict(), model.config.to_dict(), 4, 2)
