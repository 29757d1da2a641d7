"""The EAGLE-3 drafter as vLLM runs it, in trainable form.

Architecture (vLLM ``LlamaForCausalLMEagle3``, ``llama_eagle3.py``)::

    h      = fc(concat(aux_1, aux_2, aux_3))              # first step only
    x      = concat(input_layernorm(embed(tok)), hidden_norm(h))   # 2d wide
    r      = h + o_proj(attn(q/k/v_proj(x)))              # residual = un-normed h
    pre    = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(pre))                           # over the draft vocabulary
    next step: h = pre                                    # pre-norm state, no fc

Draft id ``i`` is target id ``i + d2t[i]``; ``t2d`` marks target ids that are in
the draft vocabulary. ``embed_tokens`` is the target's (shared, not saved).

How vLLM chains the steps (``SpecDecodeBaseProposer.propose``), for a chain
that starts at the last verified position ``t``:

* step 1 runs over all newly verified positions ``s`` with input token
  ``x_{s+1}`` and target state ``h_s`` at position ``s``; its keys/values stay in
  the drafter's cache, and the row at ``t`` gives draft 1;
* step ``j >= 2`` feeds draft ``j-1`` (a target id) with the previous step's
  *pre-norm* output at position ``t + j - 1``; it attends to the step-1 cache at
  positions ``<= t`` plus the keys the earlier steps of this chain wrote.

:meth:`Eagle3Drafter.ttt_forward` reproduces this for every start position
of a sequence at once (training-time test), and :meth:`Eagle3Drafter.draft_chain`
runs it step by step like the engine; tests check that the two agree and
that ``draft_chain`` reproduces vLLM's own draft tokens.

Parallel drafting (P-EAGLE; vLLM ``"parallel_drafting": true``): one forward
proposes K drafts. Behind step 1's rows come K - 1 slots at positions
``t + 1 .. t + K - 1`` whose input token is ``pard_token`` and whose state is
``fc(mask_hidden)``, a learned stand-in for the unknown intermediate tokens;
attention is causal over the request, so slot ``k`` sees step 1's keys at rows
``<= t`` and slots ``1 .. k``. Slot ``k``'s logits are the marginal of draft
``k + 1``, not conditioned on the earlier drafts. ``ttt_forward(...,
parallel=True)`` computes this for every start row at once (same labels as the
sequential recurrence).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from vllm_treespec.train.drafter_config import CONFIG_NAME, WEIGHTS_NAME, DrafterConfig


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        # A Qwen2 target's biases. vLLM's Llama attention gives o_proj a bias too
        # when attention_bias is set (left uninitialised if a checkpoint has none).
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(2 * d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * d, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(2 * d, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B,H,L,hd], k/v [B,KV,L,hd] with rotary embedding applied."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        # vLLM maps query head h to kv head h // (H / KV)
        return kv.repeat_interleave(self.n_heads // self.n_kv, dim=1)

    def attend(self, q, k1, v1, diag_k: list, diag_v: list) -> torch.Tensor:
        """Row t attends to step-1 keys at rows <= t and, for each later step of its own
        chain, that step's key at row t (the keys the engine wrote for this chain)."""
        B, H, L, hd = q.shape
        scale = 1.0 / math.sqrt(hd)
        k1, v1 = self.expand(k1), self.expand(v1)
        s1 = torch.matmul(q, k1.transpose(-1, -2)) * scale
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        s1 = s1.masked_fill(causal, float("-inf"))
        if not diag_k:
            p = torch.softmax(s1, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(p, v1)
        else:
            dk = torch.stack([self.expand(k) for k in diag_k], dim=-2)  # [B,H,L,J,hd]
            dv = torch.stack([self.expand(v) for v in diag_v], dim=-2)
            sd = (q.unsqueeze(-2) * dk).sum(-1) * scale  # [B,H,L,J]
            p = torch.softmax(torch.cat([s1, sd], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(p[..., :L], v1) + (p[..., L:].unsqueeze(-1) * dv).sum(-2)
        out = out.transpose(1, 2).reshape(B, L, H * hd)
        return self.o_proj(out)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        lc = cfg.llama_config()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(lc)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Residual + MLP after attention; returns the pre-norm output."""
        residual = hidden + attn_out
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(nn.Module):
    """Trainable EAGLE-3 head; ``embed_tokens`` is the target's (frozen, not saved)."""

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        n_aux = len(cfg.aux_layers)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if embed_weight is not None:
            self.embed_tokens.weight.data.copy_(embed_weight)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        if cfg.parallel:
            # vLLM reads it as a (1, fc input size) buffer and projects it through fc.
            self.mask_hidden = nn.Parameter(torch.zeros(1, n_aux * cfg.target_hidden_size))

    def enable_parallel(self, pard_token: int, slots: int, init_state: torch.Tensor) -> None:
        """Turn a sequential head into a parallel-drafting one: slots' token and a
        learned stand-in state, started at ``init_state`` (e.g. the mean auxiliary
        state: an all-zero state sits where hidden_norm's gradient blows up)."""
        self.cfg = dataclasses.replace(self.cfg, pard_token=int(pard_token), parallel_slots=int(slots))
        self.mask_hidden = nn.Parameter(init_state.reshape(1, -1).to(self.fc.weight).clone())

    # -- vocabulary --------------------------------------------------------
    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """``draft_ids[i]`` is the target id of draft id ``i`` (sorted ascending)."""
        draft_ids = draft_ids.to(torch.long)
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        return draft_token_ids + self.d2t[draft_token_ids]

    # -- pieces --------------------------------------------------------------
    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        return self.rotary(like, positions)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))

    # -- training-time test ----------------------------------------------------
    def ttt_forward(self, aux: torch.Tensor, tokens: torch.Tensor, num_steps: int,
                    feed_hidden: str = "prenorm", return_states: bool = False,
                    parallel: bool = False):
        """Unrolled drafting for every start row at once.

        aux:    [B, L, A*d] target auxiliary states at positions 0..L-1
        tokens: [B, L + num_steps] token ids (``tokens[:, i]`` is x_i)
        Returns a list over steps j = 1..num_steps of draft-vocab logits [B, L, Vd]
        (or, with ``return_states``, the normed states the head reads, so a caller
        can apply ``lm_head`` to the rows it needs only); row t of step j is the
        engine's j-th draft for a chain starting at t, i.e. a prediction of
        x_{t+j+1}, computed at position t+j-1 from token x_{t+j}. With
        ``parallel``, steps j >= 2 are the parallel-drafting slots instead (their
        input is ``pard_token`` and ``fc(mask_hidden)``, not x_{t+j} and step j-1's
        state); only ``tokens[:, : L + 1]`` is read then.
        """
        B, L, _ = aux.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        base_pos = torch.arange(L, device=aux.device).unsqueeze(0).expand(B, L)
        hidden = self.fc(aux)
        keys, values, out = [], [], []
        for j in range(1, num_steps + 1):
            if parallel and j >= 2:
                emb = self.embed_tokens.weight[self.cfg.pard_token].expand(B, L, -1)
                hidden = self.fc(self.mask_hidden).expand(B, L, -1)
            else:
                emb = self.embed_tokens(tokens[:, j : j + L])
            x = layer.attn_input(emb, hidden)
            cos, sin = self.rope(base_pos + (j - 1), x)
            q, k, v = attn.qkv(x, cos, sin)
            keys.append(k), values.append(v)
            a = attn.attend(q, keys[0], values[0], keys[1:], values[1:])
            pre = layer.finish(a, hidden)
            post = self.norm(pre)
            out.append(post if return_states else self.lm_head(post))
            hidden = pre if feed_hidden == "prenorm" else post
        return out

    # -- engine-style drafting (for checks) ------------------------------------
    @torch.no_grad()
    def draft_chain(self, aux: torch.Tensor, tokens: torch.Tensor, start: int, num_steps: int,
                    feed_hidden: str = "prenorm", advance_positions: bool = True,
                    fc_every_step: bool = False, forced: list[int] | None = None,
                    return_logits: bool = False):
        """Greedy chain of ``num_steps`` target-vocabulary drafts starting at ``start``.

        aux: [n, A*d] with n > start; tokens: [>= start + 2] (x_{start+1} is read).
        ``forced`` feeds the given target ids at steps 2.. instead of the drafts
        (teacher forcing, as in training). The other keyword arguments select
        deliberately wrong variants, so a check can show that only the engine's
        behaviour matches.
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        t = start
        h = self.fc(aux[None, : t + 1])  # [1, t+1, d]
        emb = self.embed_tokens(tokens[None, 1 : t + 2])
        x = layer.attn_input(emb, h)
        pos = torch.arange(t + 1, device=aux.device)[None]
        cos, sin = self.rope(pos, x)
        q, k1, v1 = attn.qkv(x, cos, sin)
        a = attn.attend(q, k1, v1, [], [])
        pre = layer.finish(a, h)[:, -1:]
        post = self.norm(pre)
        lg = self.lm_head(post)[0, -1]
        all_logits = [lg]
        tok = int(self.to_target_ids(lg.argmax()))
        drafts = [tok]
        hidden = pre if feed_hidden == "prenorm" else post
        keys, vals = [k1], [v1]
        p = t
        for step in range(num_steps - 1):
            if forced is not None:
                tok = int(forced[step])
            if advance_positions:
                p += 1
            emb = self.embed_tokens(torch.tensor([[tok]], device=aux.device))
            if fc_every_step:
                hidden = self.fc(torch.cat([hidden] * len(self.cfg.aux_layers), dim=-1))
            x = layer.attn_input(emb, hidden)
            cos, sin = self.rope(torch.tensor([[p]], device=aux.device), x)
            q, k, v = attn.qkv(x, cos, sin)
            keys.append(k), vals.append(v)
            # one query row: all cached keys are visible
            kk = torch.cat([attn.expand(kx) for kx in keys], dim=2)
            vv = torch.cat([attn.expand(vx) for vx in vals], dim=2)
            o = F.scaled_dot_product_attention(q, kk, vv)
            o = attn.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
            pre = layer.finish(o, hidden)
            post = self.norm(pre)
            lg = self.lm_head(post)[0, -1]
            all_logits.append(lg)
            tok = int(self.to_target_ids(lg.argmax()))
            drafts.append(tok)
            hidden = pre if feed_hidden == "prenorm" else post
        return (drafts, all_logits) if return_logits else drafts

    @torch.no_grad()
    def draft_parallel(self, aux: torch.Tensor, tokens: torch.Tensor, start: int,
                       num_slots: int) -> list[int]:
        """The ``num_slots`` greedy target-vocabulary drafts of one parallel-drafting
        forward at ``start`` (each the argmax of its own marginal), as vLLM proposes them."""
        L = start + 1
        toks = torch.zeros(1, L + num_slots, dtype=torch.long, device=aux.device)
        toks[0, : L + 1] = tokens[: L + 1]
        out = self.ttt_forward(aux[None, :L], toks, num_slots, parallel=True)
        return [int(self.to_target_ids(lg[0, start].argmax())) for lg in out]

    # -- checkpoint ------------------------------------------------------------
    def export_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Weights under the names vLLM's Eagle3 loader expects."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith(("embed_tokens", "rotary")):
                continue
            if name in ("d2t",):
                out[name] = t.to(torch.int64).contiguous()
            elif name == "t2d":
                out[name] = t.to(torch.bool).contiguous()
            else:
                out[name] = t.to(dtype).contiguous()
        return out

    def save_checkpoint(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        dname = str(dtype).replace("torch.", "")
        (out_dir / CONFIG_NAME).write_text(json.dumps(self.cfg.to_hf_dict(dname), indent=2) + "\n")
        save_file(self.export_state_dict(dtype), str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        return out_dir

    @classmethod
    def load_checkpoint(cls, ckpt_dir: str | Path, embed_weight: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> "Eagle3Drafter":
        from safetensors.torch import load_file

        ckpt_dir = Path(ckpt_dir)
        cfg = DrafterConfig.from_hf_dict(json.loads((ckpt_dir / CONFIG_NAME).read_text()))
        model = cls(cfg, embed_weight=embed_weight)
        state = load_file(str(ckpt_dir / WEIGHTS_NAME))
        state = {k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith(("embed_tokens", "rotary"))]
        if missing or unexpected:
            raise ValueError(f"checkpoint {ckpt_dir}: missing {missing}, unexpected {unexpected}")
        return model.to(dtype)
