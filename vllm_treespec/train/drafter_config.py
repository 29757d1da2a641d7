"""The drafter's shape, and the ``config.json`` vLLM's ``LlamaForCausalLMEagle3``
reads for it (written with the weights, read back by the checker and trainer)."""

from __future__ import annotations

import dataclasses

from transformers import LlamaConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclasses.dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Parallel drafting (P-EAGLE): the input token of the K - 1 slots after the
    # bonus token (``pard_token`` in config.json, what vLLM reads), and how many
    # draft positions the head was trained for (ours; vLLM ignores it).
    pard_token: int | None = None
    parallel_slots: int = 0
    # The target's RoPE (type and scaling; the head's attention rotates as the
    # target's layers do), and whether its q/k/v projections carry biases (Qwen2).
    rope_parameters: dict | None = None
    attention_bias: bool = False

    @property
    def parallel(self) -> bool:
        return self.pard_token is not None

    def __post_init__(self):
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}

    # Targets whose decoder layers a Llama-style head (vLLM's LlamaForCausalLMEagle3,
    # what the published heads for these models are) starts from: Llama 2/3,
    # Mistral, Qwen2/2.5 (the head keeps their q/k/v biases) and Qwen3 (its per-head
    # q/k norm weights are folded into the projections; see target_weights).
    TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")
    # RoPE types whose rotation transformers' rotary embedding (the trainer's) and
    # vLLM's get_rope (the engine's) compute alike, checked by test_twin_heads
    # (``dynamic`` is not: transformers scales only past the original context).
    ROPE_TYPES = ("default", "llama3", "yarn")

    @classmethod
    def unsupported_target(cls, target_config) -> str | None:
        """Why a head cannot be trained for this target (None: it can). Read at
        argument parsing, before any stage runs: the train stage would find out
        only after the prompt, generation and vocabulary stages."""
        c = target_config
        rope = _target_rope(c)
        if c.model_type not in cls.TARGET_TYPES:
            return (f"target model_type {c.model_type!r}; allowed: {list(cls.TARGET_TYPES)} "
                    f"(the head is a Llama decoder layer initialised from the target's last "
                    f"one)")
        if rope["rope_type"] not in cls.ROPE_TYPES:
            return (f"target rope_type {rope['rope_type']!r}; allowed: {list(cls.ROPE_TYPES)}")
        return None

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layers) -> "DrafterConfig":
        c = target_config
        why = cls.unsupported_target(c)
        if why is not None:
            raise NotImplementedError(why)
        rope = _target_rope(c)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=c.max_position_embeddings,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=c.hidden_size,
            aux_layers=tuple(int(x) for x in aux_layers),
            hidden_act=getattr(c, "hidden_act", "silu"),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_id=getattr(c, "eos_token_id", None),
            rope_parameters=rope,
            # Qwen2 has biases without saying so in its config
            attention_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")),
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            num_hidden_layers=1,
        )

    def to_hf_dict(self, dtype: str) -> dict:
        """``config.json`` in the layout vLLM's ``LlamaForCausalLMEagle3`` reads."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": dict(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "torch_dtype": dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                "use_aux_hidden_state": True,
            },
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            d["eos_token_id"] = self.eos_token_id
        if self.parallel:
            d["pard_token"] = self.pard_token
            d["parallel_drafting_slots"] = self.parallel_slots
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        rope = _rope_dict(d.get("rope_parameters") or d.get("rope_scaling"), d.get("rope_theta"))
        theta = rope["rope_theta"]
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d["rms_norm_eps"],
            rope_theta=theta,
            rope_parameters=rope,
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=d["max_position_embeddings"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d["draft_vocab_size"],
            target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
            aux_layers=tuple(d["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pard_token=d.get("pard_token"),
            parallel_slots=int(d.get("parallel_drafting_slots", 0)),
        )


def _target_rope(c) -> dict:
    """The target config's RoPE as one dict (see ``_rope_dict``)."""
    return _rope_dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None),
                      getattr(c, "rope_theta", None))


def _rope_dict(rope: dict | None, theta: float | None) -> dict:
    """RoPE as one dict (``rope_type``, ``rope_theta`` and the scaling keys), from a
    ``rope_parameters`` dict or, as older config.json files (and heads) write it, a
    ``rope_scaling`` dict (``type`` or ``rope_type``) beside a top-level ``rope_theta``."""
    rope = dict(rope or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", None)) or "default"
    rope["rope_theta"] = float(rope.get("rope_theta", theta or 10000.0))
    return rope
