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

    @property
    def parallel(self) -> bool:
        return self.pard_token is not None

    # Targets whose last decoder layer a Llama-style head reproduces (the head is
    # initialised from it): no q/k norm, no qkv bias, RoPE without scaling.
    TARGET_TYPES = ("llama", "mistral")

    @classmethod
    def unsupported_target(cls, target_config) -> str | None:
        """Why a head cannot be trained for this target yet (None: it can). Read at
        argument parsing, before any stage runs: the train stage would find out
        only after the prompt, generation and vocabulary stages."""
        c = target_config
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if c.model_type not in cls.TARGET_TYPES:
            return (f"target model_type {c.model_type!r}; allowed: {list(cls.TARGET_TYPES)} "
                    f"(the head is a Llama decoder layer initialised from the target's last "
                    f"one; q/k norms and qkv biases would be dropped)")
        if rope_type not in ("default", None):
            return (f"target rope_type {rope_type!r}; allowed: 'default' (the head's "
                    f"attention has no RoPE scaling yet)")
        return None

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layers) -> "DrafterConfig":
        c = target_config
        why = cls.unsupported_target(c)
        if why is not None:
            raise NotImplementedError(why)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=c.max_position_embeddings,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=c.hidden_size,
            aux_layers=tuple(int(x) for x in aux_layers),
            hidden_act=getattr(c, "hidden_act", "silu"),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_id=getattr(c, "eos_token_id", None),
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act=self.hidden_act,
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
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
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
        rope = d.get("rope_parameters") or {}
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
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
