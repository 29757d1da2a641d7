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
                          draft_ids: Sequence[int] | None = None) -> Path:
    """``draft_ids``: the target ids of the draft vocabulary, in order (default:
    the first ``draft_vocab`` ids)."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target_dir / "config.json").read_text())
    d = tcfg["hidden_size"]
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or d // heads
    inter, vocab = tcfg["intermediate_size"], tcfg["vocab_size"]
    n_layers = tcfg["num_hidden_layers"]
    aux = list(aux_layers or (2, n_layers // 2, n_layers - 3))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": d, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "target_hidden_size": d,
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
        "fc.weight": w(d, 3 * d),
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
        # Draft id i is target id ids[i] = i + d2t[i].
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.isin(torch.arange(vocab), ids),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out_dir / "model.safetensors"))
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
    """``random_eagle3_drafter``'s head converted to the ``speculators`` format (what
    ``speculators convert`` writes for an EAGLE-3 head, speculators 0.9.0): a
    config.json with ``speculators_model_type`` / ``speculators_config`` (verifier:
    ``target_dir``) and the decoder layer's sizes in ``transformer_layer_config``,
    weights under ``layers.0.*`` instead of ``midlayer.*``, no ``embed_tokens``
    (shared with the target). ``random_kwargs`` go to ``random_eagle3_drafter``.

    ``norm_before_residual`` False computes what the original-layout head does
    (vLLM's ``LlamaForCausalLMEagle3`` reads no such key and defaults to False);
    published heads mostly set it True, and vLLM's speculators reader defaults an
    absent one to True, so it is always written out."""
    from safetensors.torch import load_file

    out_dir = random_eagle3_drafter(target_dir, out_dir, **random_kwargs)
    head = json.loads((out_dir / "config.json").read_text())
    target = json.loads((Path(target_dir) / "config.json").read_text())
    layer = {key: head[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps",
        "max_position_embeddings", "hidden_act", "tie_word_embeddings")}
    layer.update(model_type="llama", attention_bias=False, mlp_bias=False,
                 rope_parameters={"rope_theta": head["rope_theta"], "rope_type": "default"})
    config = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "accept_tolerance": 0.0,
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(target_dir),
                         "architectures": target.get("architectures", [])}},
        "draft_vocab_size": head["draft_vocab_size"],
        "norm_before_residual": norm_before_residual, "norm_before_fc": False,
        "fc_norm": False, "norm_output": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids":
            head["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "embed_requires_grad": False, "tie_word_embeddings": False, "dtype": "float32",
        "transformer_layer_config": layer,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    weights = load_file(str(out_dir / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0.", 1): v for k, v in weights.items()},
              str(out_dir / "model.safetensors"))
    return out_dir
