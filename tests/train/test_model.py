"""The trainable drafter: training-time test equals engine-style drafting; checkpoint format."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from vllm_treespec.train.drafter_config import DrafterConfig
from vllm_treespec.train.model import Eagle3Drafter


def tiny_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                vocab_size=100, draft_vocab_size=40, target_hidden_size=32, aux_layers=(2, 5, 8))
    base.update(kw)
    return DrafterConfig(**base)


def tiny_model(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    m = Eagle3Drafter(tiny_config())
    m.set_vocab(torch.randperm(100)[:40].sort().values)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # non-trivial norms and weights
    return m.eval()


@pytest.mark.parametrize("feed", ["prenorm", "postnorm"])
def test_ttt_forward_equals_step_by_step_drafting(feed):
    """Row t of unrolled step j == the j-th step of a chain started at t (teacher forced)."""
    m = tiny_model()
    K, L = 4, 23
    aux = torch.randn(2, L, 3 * 32) * 2
    toks = torch.randint(0, 100, (2, L + K))
    with torch.no_grad():
        out = m.ttt_forward(aux, toks, K, feed_hidden=feed)
    for b in range(2):
        for t in range(L - K):
            forced = [int(toks[b, t + j]) for j in range(2, K + 1)]
            _, logits = m.draft_chain(aux[b], toks[b], t, K, feed_hidden=feed, forced=forced,
                                      return_logits=True)
            for j in range(K):
                torch.testing.assert_close(out[j][b, t], logits[j], atol=2e-5, rtol=1e-4)


def test_drafts_follow_the_argmax_through_d2t():
    m = tiny_model(1)
    aux = torch.randn(12, 96)
    toks = torch.randint(0, 100, (16,))
    drafts, logits = m.draft_chain(aux, toks, 8, 3, return_logits=True)
    ids = m.draft_ids
    assert drafts == [int(ids[lg.argmax()]) for lg in logits]
    assert all(bool(m.t2d[d]) for d in drafts)


def test_checkpoint_layout_matches_vllm_eagle3(tmp_path):
    m = tiny_model()
    m.save_checkpoint(tmp_path, dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 100
    assert cfg["target_hidden_size"] == 32
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 5, 8], "use_aux_hidden_state": True}
    d, hd = 32, 8
    expected = {
        "fc.weight": (d, 3 * d),
        "midlayer.input_layernorm.weight": (d,),
        "midlayer.hidden_norm.weight": (d,),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (4 * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (2 * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (2 * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, 4 * hd),
        "midlayer.mlp.gate_proj.weight": (64, d),
        "midlayer.mlp.up_proj.weight": (64, d),
        "midlayer.mlp.down_proj.weight": (d, 64),
        "norm.weight": (d,),
        "lm_head.weight": (40, d),
        "d2t": (40,),
        "t2d": (100,),
    }
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert shapes == expected  # no embed_tokens: vLLM shares the target's
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    assert dtypes["fc.weight"] == torch.bfloat16
    back = Eagle3Drafter.load_checkpoint(tmp_path, embed_weight=m.embed_tokens.weight)
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    torch.testing.assert_close(back.fc.weight, m.fc.weight.to(torch.bfloat16).float())
    assert DrafterConfig.from_hf_dict(cfg) == m.cfg


def tiny_parallel_model(seed=0) -> Eagle3Drafter:
    m = tiny_model(seed)
    m.enable_parallel(pard_token=7, slots=4, init_state=torch.randn(96))
    return m.eval()


def causal_parallel_reference(m: Eagle3Drafter, aux, tokens, t: int, K: int) -> list:
    """What vLLM's parallel drafting computes at start ``t``, written as a plain causal
    pass over one sequence: rows 0..t (token x_{s+1}, state fc(aux_s)) followed by
    K - 1 slots (pard_token, fc(mask_hidden)) at positions t+1..t+K-1."""
    layer, attn = m.midlayer, m.midlayer.self_attn
    n = t + K
    emb = torch.cat([m.embed_tokens(tokens[1 : t + 2]),
                     m.embed_tokens.weight[m.cfg.pard_token].expand(K - 1, -1)])[None]
    hidden = torch.cat([m.fc(aux[: t + 1]), m.fc(m.mask_hidden).expand(K - 1, -1)])[None]
    x = layer.attn_input(emb, hidden)
    cos, sin = m.rope(torch.arange(n)[None], x)
    q, k, v = attn.qkv(x, cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(q, attn.expand(k), attn.expand(v),
                                                         is_causal=True)
    o = attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
    return list(m.logits(layer.finish(o, hidden))[0, t:])


def test_parallel_ttt_forward_equals_one_causal_pass_per_start():
    """Row t of slot j == vLLM's layout for a request whose last verified row is t,
    for every t at once; tokens after x_{t+1} must not matter."""
    m = tiny_parallel_model()
    K, L = 4, 19
    aux = torch.randn(2, L, 96) * 2
    toks = torch.randint(0, 100, (2, L + K))
    with torch.no_grad():
        out = m.ttt_forward(aux, toks, K, parallel=True)
        scrambled = toks.clone()
        scrambled[:, L + 1 :] = torch.randint(0, 100, scrambled[:, L + 1 :].shape)
        again = m.ttt_forward(aux, scrambled, K, parallel=True)
        for b in range(2):
            for t in range(L):
                ref = causal_parallel_reference(m, aux[b], toks[b], t, K)
                for j in range(K):
                    torch.testing.assert_close(out[j][b, t], ref[j], atol=2e-5, rtol=1e-4)
        sequential = m.ttt_forward(aux, toks, K)
    for j in range(K):
        torch.testing.assert_close(again[j], out[j])
    torch.testing.assert_close(sequential[0], out[0])  # the first draft is the same pass
    assert not torch.allclose(sequential[1], out[1])  # the slots are not the chain's steps
    m2 = tiny_parallel_model()
    drafts = m2.draft_parallel(aux[0], toks[0], 10, K)
    assert drafts == [int(m2.draft_ids[out[j][0, 10].argmax()]) for j in range(K)]


def test_parallel_checkpoint_carries_pard_token_and_mask_hidden(tmp_path):
    m = tiny_parallel_model()
    m.save_checkpoint(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["pard_token"] == 7 and cfg["parallel_drafting_slots"] == 4
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("mask_hidden").get_shape()) == (1, 96)  # vLLM: (1, fc input)
    back = Eagle3Drafter.load_checkpoint(tmp_path, embed_weight=m.embed_tokens.weight)
    torch.testing.assert_close(back.mask_hidden, m.mask_hidden)
    assert back.cfg == m.cfg and back.cfg.parallel
    sequential = json.loads(json.dumps(cfg))
    for key in ("pard_token", "parallel_drafting_slots"):
        sequential.pop(key)
    assert not DrafterConfig.from_hf_dict(sequential).parallel


def test_training_makes_or_continues_parallel_slots():
    """--parallel K: a sequential head gets K slots (stand-in state: the mean
    auxiliary state); a parallel head keeps its pard_token and is retrained for K
    slots; a pard_token outside the vocabulary or unlike the head's is refused."""
    import types

    import numpy as np

    from vllm_treespec.train.trainer import TrainConfig, _make_parallel

    seqs = [types.SimpleNamespace(hidden=np.random.rand(5, 4, 32).astype(np.float16))
            for _ in range(2)]
    mean = torch.cat([torch.from_numpy(s.hidden[:, :-1]).float().flatten(1) for s in seqs]).mean(0)
    cfg = TrainConfig(target="t", aux_layers=(2, 5, 8), parallel=True, ttt_steps=3)
    m = tiny_model()
    _make_parallel(m, cfg, seqs, "cpu")
    assert m.cfg.pard_token == 0 and m.cfg.parallel_slots == 3
    torch.testing.assert_close(m.mask_hidden[0], mean)
    _make_parallel(m, dataclasses.replace(cfg, ttt_steps=5), seqs, "cpu")
    assert m.cfg.pard_token == 0 and m.cfg.parallel_slots == 5
    with pytest.raises(ValueError, match="was trained with pard_token 0"):
        _make_parallel(m, dataclasses.replace(cfg, pard_token=3), seqs, "cpu")
    with pytest.raises(ValueError, match=r"--pard-token 100: a token id in \[0, 99\]"):
        _make_parallel(tiny_model(), dataclasses.replace(cfg, pard_token=100), seqs, "cpu")
