"""Drafter checkpoints for integration tests.

``random_eagle3_drafter`` writes a randomly initialised EAGLE-3 head in the
format vLLM's ``LlamaForCausalLMEagle3`` loads: it exercises the real drafting
code (first pass, tree levels, side-buffer attention) but rarely guesses right,
so acceptance is tested with an oracle on top of it (see ``oracle``).
``never_right_drafter`` is one whose drafts are never accepted, by construction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file


def random_eagle3_drafter(target_dir: str | Path, out_dir: str | Path,
                          draft_vocab: int = 4096, seed: int = 0,
                          aux_layers: tuple[int, int, int] | None = None,
                          draft_ids: Sequence[int] | None = None,
                          layout: str = "safetensors", hidden_size: int | None = None) -> Path:
    """``draft_ids``: the target ids of the draft vocabulary, in order (default:
    the first ``draft_vocab`` ids). The layouts heads are published in:
    ``layout`` "bin" writes ``pytorch_model.bin`` (the original EAGLE-3 releases);
    ``draft_vocab`` equal to the target's vocabulary writes no ``d2t``/``t2d`` (a
    full-vocabulary head); ``hidden_size`` narrower than the target's writes a head
    of that width with ``target_hidden_size`` (its ``fc`` reads the target's width)
    and its own ``embed_tokens`` (the target's are too wide to share)."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target_dir / "config.json").read_text())
    target_d = tcfg["hidden_size"]
    d = hidden_size or target_d
    head_dim = tcfg.get("head_dim") or target_d // tcfg["num_attention_heads"]
    # a narrower head keeps the head size and the GQA ratio, with fewer heads
    heads = tcfg["num_attention_heads"] * d // target_d
    kv_heads = max(1, tcfg["num_key_value_heads"] * d // target_d)
    inter, vocab = tcfg["intermediate_size"] * d // target_d, tcfg["vocab_size"]
    n_layers = tcfg["num_hidden_layers"]
    aux = list(aux_layers or (2, n_layers // 2, n_layers - 3))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": d, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": target_d,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-5),
        "rope_theta": tcfg.get("rope_theta", 10000.0),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 8192),
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux,
                         "use_aux_hidden_state": True},
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    ids = torch.tensor(list(draft_ids) if draft_ids is not None else range(draft_vocab))
    assert ids.numel() == draft_vocab and ids.unique().numel() == draft_vocab
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    tensors = {
        "fc.weight": w(d, len(aux) * target_d),
        "midlayer.input_layernorm.weight": torch.ones(d),
        "midlayer.hidden_norm.weight": torch.ones(d),
        "midlayer.post_attention_layernorm.weight": torch.ones(d),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": w(d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, d),
        "midlayer.mlp.up_proj.weight": w(inter, d),
        "midlayer.mlp.down_proj.weight": w(d, inter),
        "norm.weight": torch.ones(d),
        "lm_head.weight": w(draft_vocab, d, scale=1.0),
    }
    if draft_vocab < vocab:  # draft id i is target id ids[i] = i + d2t[i]
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        tensors["t2d"] = torch.isin(torch.arange(vocab), ids)
    if d != target_d:
        tensors["embed_tokens.weight"] = w(vocab, d, scale=1.0)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if layout == "bin":
        torch.save(tensors, out_dir / "pytorch_model.bin")
    else:
        assert layout == "safetensors", layout
        save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def never_right_drafter(target_dir: str | Path, out_dir: str | Path,
                        outputs: Iterable[Sequence[int]], draft_vocab: int = 4096) -> Path:
    """A random head whose draft vocabulary holds no token of ``outputs``.

    Greedy verification accepts a draft only where it equals the token the
    target outputs there, so for requests whose greedy answers are ``outputs``
    (a test asserts they are) no draft of this head is ever accepted: its
    acceptance is 0 by construction, not by the luck of random weights."""
    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    used = {t for out in outputs for t in out}
    ids = [t for t in range(vocab - 1, -1, -1) if t not in used][:draft_vocab]
    return random_eagle3_drafter(target_dir, out_dir, draft_vocab, draft_ids=sorted(ids))


def speculators_eagle3_drafter(target_dir: str | Path, out_dir: str | Path,
                               norm_before_residual: bool = False,
                               speculative_tokens: int = 3, **random_kwargs) -> Path:
    """``random_eagle3_drafter``'s head converted to the ``speculators`` format by the
    product's own exporter (``train.export.write_speculators_layout``, the layout
    ``speculators convert`` writes for an EAGLE-3 head), verifier ``target_dir``.
    ``random_kwargs`` go to ``random_eagle3_drafter``."""
    import shutil

    from vllm_treespec.train.export import write_speculators_layout

    out_dir = Path(out_dir)
    original = random_eagle3_drafter(target_dir, out_dir.with_name(out_dir.name + "-original"),
                                     **random_kwargs)
    write_speculators_layout(original, out_dir, str(target_dir), speculative_tokens,
                             norm_before_residual)
    shutil.rmtree(original)
    return out_dir
