"""Architecture twins: tiny checkpoints of real model families, built in code.

Each twin is the ``config.json`` of one published model with its width, depth and
vocabulary shrunk, every other field kept as the model ships it, and random
weights (fixed seed) created and saved by transformers' own model class, so its
tensor names, shapes, biases, q/k norms, expert layout and tying are those of the
real checkpoints. vLLM then serves it with its own model class for that
architecture (``architectures`` in the config), which is what the tree path has
to get right: the SmolLM2 target of the other tests is one Llama only.

The vocabulary is SmolLM2's (49152 ids, its tokenizer files are copied in; bos and
eos come from that tokenizer), so the twins take the same chat prompts.

Shrunk in every twin: ``hidden_size`` (128 to 256), ``intermediate_size`` (the
model's ratio to hidden, roughly), ``num_hidden_layers`` 4, the attention heads
(head_dim 32; the model's ratio of query to KV heads kept; an explicit
``head_dim`` stays explicit, and where the published model's query width differs
from its hidden size, the twin's does too), ``vocab_size`` and the token ids.
Random biases (Qwen2's q/k/v), where transformers starts them at zero.
Raised: ``initializer_range`` (``INIT_STD``): at the published 0.02 a random twin's
residual stream is its input token's embedding, barely moved by its layers, so a
tied twin repeats its last prompt token whatever its attention computes; at 0.1
each twin's greedy continuation depends on its context (dropping the first prompt
token changes nearly every output token), so a tree verified with the wrong
attention, positions or KV shows in the output.
Kept: everything else, among which the fields each entry of ``TWINS`` names.
EAGLE-3's default auxiliary layers (2, L // 2, L - 3) collide for L < 7 (vLLM
gathers a repeated layer once), so the twins' heads name theirs (``AUX_LAYERS``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

# What the twins' heads read (distinct, inside the 4 layers: low, middle, high).
AUX_LAYERS = (1, 2, 3)
NUM_LAYERS = 4
SEED = 0
INIT_STD = 0.1
VOCAB = 49152  # SmolLM2's tokenizer
# Copied from the SmolLM2 target: the tokenizer and its chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class Twin:
    follows: str            # the published model whose config.json this is
    published: dict[str, Any]  # its config.json, less the token ids (set from the tokenizer)
    shrunk: dict[str, Any]     # the sizes that replace its own
    kept: str               # what the twin is for: the fields that make the architecture

    def config(self, bos: int, eos: int) -> dict[str, Any]:
        return dict(self.published, **self.shrunk, num_hidden_layers=NUM_LAYERS,
                    initializer_range=INIT_STD, vocab_size=VOCAB, bos_token_id=bos,
                    eos_token_id=eos)


TWINS: dict[str, Twin] = {
    "llama3": Twin(
        follows="meta-llama/Llama-3.2-1B",
        published={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": 64,
            "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
            "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192,
                             "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": 128256},
        shrunk={"hidden_size": 128, "intermediate_size": 512, "head_dim": 32,
                "num_attention_heads": 4, "num_key_value_heads": 1},
        kept="llama3 RoPE scaling (factor 32, low/high frequency factors 1/4, original "
             "context 8192) on rope_theta 500000, tied embeddings, GQA 4:1, explicit "
             "head_dim"),
    "qwen3": Twin(
        follows="Qwen/Qwen3-8B",
        published={
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
            "intermediate_size": 12288, "max_position_embeddings": 40960,
            "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 151936},
        # 8 x 32 query width on hidden 128, as Qwen3-0.6B's 16 x 128 on 1024
        shrunk={"hidden_size": 128, "intermediate_size": 384, "head_dim": 32,
                "num_attention_heads": 8, "num_key_value_heads": 2, "max_window_layers": 4},
        kept="q/k RMSNorm per head (the architecture's), explicit head_dim decoupled "
             "from hidden_size, attention_bias false, untied lm_head, rope_theta 1e6, "
             "GQA 4:1, rms_norm_eps 1e-6, no sliding window"),
    "qwen2.5": Twin(
        follows="Qwen/Qwen2.5-0.5B",
        published={
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 896,
            "initializer_range": 0.02, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 24,
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
            "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936},
        # no head_dim key (hidden / heads = 32), as published
        shrunk={"hidden_size": 224, "intermediate_size": 1216,
                "num_attention_heads": 7, "num_key_value_heads": 1, "max_window_layers": 4},
        kept="q/k/v projection biases (the architecture's), tied embeddings, rope_theta "
             "1e6, GQA 7:1, sliding_window 32768 present but use_sliding_window false "
             "(vLLM must serve full attention: the tree path refuses sliding windows)"),
    "qwen3-moe": Twin(
        follows="Qwen/Qwen3-30B-A3B",
        published={
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 6144,
            "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
            "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
            "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
            "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        # 8 x 32 query width on hidden 128, as its 32 x 128 on 2048
        shrunk={"hidden_size": 128, "intermediate_size": 384, "head_dim": 32,
                "num_attention_heads": 8, "num_key_value_heads": 1, "max_window_layers": 4,
                "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2},
        kept="sparse MoE in every layer (decoder_sparse_step 1, mlp_only_layers []), "
             "top-k routing renormalised (norm_topk_prob true), q/k RMSNorm, explicit "
             "head_dim decoupled from hidden_size, untied lm_head, GQA 8:1"),
    "mistral": Twin(
        follows="mistralai/Mistral-7B-v0.3",
        published={
            "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32768},
        # no head_dim key (hidden / heads = 32), as published
        shrunk={"hidden_size": 256, "intermediate_size": 896,
                "num_attention_heads": 8, "num_key_value_heads": 2},
        kept="sliding_window null (full attention, as v0.3 and Mistral-Nemo), "
             "rope_theta 1e6, untied lm_head, GQA 4:1, vLLM's MistralForCausalLM"),
}


def build_twin(name: str, out_dir: str | Path, tokenizer_dir: str | Path,
               **changes: Any) -> Path:
    """Write twin ``name`` of ``TWINS`` to ``out_dir``: its config.json (the published
    fields, shrunk, then ``changes``), model.safetensors (transformers' layout and
    init, seed ``SEED``, saved in the published dtype) and the tokenizer files of
    ``tokenizer_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    twin = TWINS[name]
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == VOCAB, f"{tokenizer_dir}: {len(tokenizer)} tokens, not {VOCAB}"
    config = dict(twin.config(tokenizer.bos_token_id, tokenizer.eos_token_id), **changes)
    config_json = json.dumps(config, indent=2)
    (out_dir / "config.json").write_text(config_json)
    # Parsed as vLLM parses it (transformers' AutoConfig), then the weights.
    hf_config = AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # transformers starts biases at zero: they would test nothing
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_STD)
    model.to(getattr(torch, config["torch_dtype"]))
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained writes the config in this transformers' own form; keep the
    # published one (what a checkpoint of that model ships).
    (out_dir / "config.json").write_text(config_json)
    for f in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / f, out_dir / f)
    return out_dir
