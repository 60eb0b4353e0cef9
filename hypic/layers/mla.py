"""Multi-head latent attention (DeepSeek-V2 style) as Kimi-Linear uses it.

Keys and values come from a compressed latent: kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_rot
(qk_rope_head_dim, shared by all heads)], c is RMS-normed and expanded by kv_b_proj into per-head
k_nope and v; k = [k_nope | k_rot]. Kimi-Linear's MLA layers are NoPE (transformers applies no
rotary embedding to q or k_rot), so keys carry no position and a cached segment's keys are placed
at any position unchanged. The buffer keeps expanded per-head keys and values (not the latent).
"""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from .attention import RopeAttention
from .norm import ScaledRMSNorm


class MultiHeadLatentAttention(RopeAttention):
    """rotary None: NoPE (Kimi-Linear); a subclass that places keys by RoPE passes its Rotary (models/bailing_hybrid.py).
    norm_eps: the latents' RMSNorms' (Kimi-Linear 1e-6; GLM-5 Next the config's)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary=None, norm_eps: float = 1e-6):
        super().__init__(layer_idx, ops, rotary)
        p = cfg.params
        hs = cfg.hidden_size
        self.nh = self.num_kv_heads = p.num_attention_heads
        self.nope, self.rope, self.vd = p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = p.kv_lora_rank, p.q_lora_rank
        self.key_dim, self.value_dim = self.nope + self.rope, self.vd
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hs, self.nh * self.key_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hs, self.q_lora_rank, bias=p.attention_bias)
            self.q_a_layernorm = ScaledRMSNorm(self.q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.nh * self.key_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hs, self.kv_lora_rank + self.rope, bias=p.attention_bias)
        self.kv_a_layernorm = ScaledRMSNorm(self.kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, hs, bias=p.attention_bias)
        self.scale = self.key_dim ** -0.5

    def query(self, x):
        """(q [N, H, key_dim], the query latent q_a_layernorm(q_a_proj(x)), or None without a q LoRA)."""
        if self.q_lora_rank is None:
            return self.q_proj(x).view(x.shape[0], self.nh, self.key_dim), None
        latent = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(latent).view(x.shape[0], self.nh, self.key_dim), latent

    def keys_values(self, x):
        """(k_nope [N, H, nope], k_rot [N, rope] shared by the heads, v [N, H, vd]) from the KV latent."""
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(x.shape[0], self.nh, self.nope + self.vd)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        return k_nope, k_rot, v

    def project(self, x, batch):
        """Keys [k_nope | k_rot]; the extra is the query latent (GLM-5 Next's indexer reads it; output ignores it)."""
        n = x.shape[0]
        q, latent = self.query(x)
        k_nope, k_rot, v = self.keys_values(x)
        k = k_nope.new_empty(n, self.nh, self.key_dim)
        k[..., : self.nope] = k_nope
        k[..., self.nope :] = k_rot[:, None, :]
        return q, k, v, latent

    def output(self, x, out, extra):
        return self.o_proj(out.reshape(x.shape[0], -1))
