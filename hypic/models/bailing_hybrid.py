"""Ling 3.0 (`bailing_hybrid`, inclusionAI): Kimi-Linear's layout (KDA layers with an MLA layer closing every group
of `layer_group_size`, dense MLPs on the first layers, a DeepSeek MoE with sigmoid grouped routing and shared experts
elsewhere) with three differences:

  - KDA's forget gate is full rank, log decay g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias)) (the
    bounded "safe" gate; -exp(A_log) * softplus(...) without it), and its output gate one full-rank g_proj;
  - MLA carries RoPE on the rope dims shared by the heads, in DeepSeek's interleaved layout: pairs (x0, x1),
    (x2, x3), ... rotate together, which is rotate-half RoPE on the dims reordered evens-then-odds. Queries and keys
    are laid out here as [rope dims reordered | nope dims] (scores are unchanged: q and k get the same order), so a
    cached key is stored before RoPE and placed at any position by the shared rotate-half machinery;
  - MLA's output is gated per head by sigmoid(g_proj(x)).

Parameter names are transformers'; the released layout (`attention.`, `dense`, `word_embeddings`, q/k/v_conv1d,
per-expert tensors, `expert_bias`, the MTP layers after the last decoder layer) is mapped by the converter."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import RopeAttention
from ..layers.kda import KimiDeltaAttention
from ..layers.mlp import MLP
from ..layers.norm import ScaledRMSNorm
from ..layers.rope import Rotary
from ..runtime.batch import ForwardBatch
from .kimi_linear import KimiLinearForCausalLM, KimiMoe


class BailingForgetGate(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, safe: bool, lower_bound: float):
        super().__init__()
        self.heads, self.head_dim, self.safe, self.lower_bound = heads, head_dim, safe, lower_bound
        self.f_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        """-> log decay g [N, H, K] fp32."""
        f = (self.f_proj(x).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        rate = self.A_log.float().exp()[:, None]
        if self.safe:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * torch.nn.functional.softplus(f)


class BailingDeltaAttention(KimiDeltaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        p = cfg.params
        hs = cfg.hidden_size
        del self.g_a_proj, self.g_b_proj
        self.forget_gate = BailingForgetGate(hs, self.h, self.d, p.kda_safe_gate, p.kda_lower_bound)
        self.g_proj = nn.Linear(hs, self.qkv_dim, bias=False)

    def features(self, x, batch):
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return {"raw": raw, "g": self.forget_gate(x), "beta": torch.sigmoid(self.b_proj(x)), "gate": self.g_proj(x)}


class BailingLatentAttention(RopeAttention):
    """MLA with RoPE on the shared rope dims (see the module docstring for the layout)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
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
            self.q_a_layernorm = ScaledRMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.nh * self.key_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hs, self.kv_lora_rank + self.rope, bias=p.attention_bias)
        self.kv_a_layernorm = ScaledRMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, hs, bias=p.attention_bias)
        self.g_proj = nn.Linear(hs, self.nh, bias=False)
        self.scale = self.key_dim ** -0.5
        # interleaved pairs -> rotate-half halves: evens first, then odds (a plain list: no parameter, no buffer)
        self._order = list(range(0, self.rope, 2)) + list(range(1, self.rope, 2))

    def project(self, x, batch):
        n = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(n, self.nh, self.key_dim).split([self.nope, self.rope], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(c)).view(n, self.nh, self.nope + self.vd).split(
            [self.nope, self.vd], dim=-1)
        order = torch.tensor(self._order, device=x.device)
        q = torch.cat([q_rot.index_select(-1, order), q_nope], dim=-1)
        k = torch.cat([k_rot.index_select(-1, order)[:, None, :].expand(n, self.nh, self.rope), k_nope], dim=-1)
        return q, k, v, self.g_proj(x)

    def output(self, x, out, gate):
        n = x.shape[0]
        g = torch.sigmoid(gate.float()).to(out.dtype)
        return self.o_proj((out.view(n, self.nh, self.vd) * g[..., None]).reshape(n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        self.self_attn = (BailingLatentAttention(cfg, i, ops, rotary) if cfg.layer_types[i] == FULL
                          else BailingDeltaAttention(cfg, i, ops))
        self.mlp = KimiMoe(cfg, ops) if i in p.moe_layers else MLP(cfg.hidden_size, p.intermediate_size)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        p = cfg.params
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg, p.qk_rope_head_dim, dict(p.rope_parameters))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, self.rotary) for i in range(cfg.num_layers))
        self.norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        super(KimiLinearForCausalLM, self).__init__(cfg, Backbone(cfg, ops))
