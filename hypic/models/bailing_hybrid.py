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

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.kda import KimiDeltaAttention, head_rate_log_decay
from ..layers.mla import MultiHeadLatentAttention
from . import kimi_linear
from .base import Backbone, CausalLM
from .kimi_linear import KimiLinearForCausalLM


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
        return head_rate_log_decay(f, self.A_log, self.lower_bound if self.safe else None)


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


def yarn_softmax_mscale(rope: dict) -> float:
    """DeepSeek's YaRN also scales the attention logits: by mscale ** 2, mscale = 0.1 * mscale_all_dim * ln(factor) + 1
    (1 at factor <= 1, or without `mscale_all_dim`); the cos / sin tables carry YaRN's own attention factor."""
    factor, m = float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim", 0.0) or 0.0)
    if rope.get("rope_type", "default") == "default" or not m or factor <= 1:
        return 1.0
    return 0.1 * m * math.log(factor) + 1.0


class BailingLatentAttention(MultiHeadLatentAttention):
    """MLA with RoPE on the shared rope dims (see the module docstring for the layout) and a per-head output gate."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.g_proj = nn.Linear(cfg.hidden_size, self.nh, bias=False)
        self.scale *= yarn_softmax_mscale(dict(cfg.params.rope_parameters)) ** 2
        # interleaved pairs -> rotate-half halves: evens first, then odds (a plain list: no parameter, no buffer)
        self._order = list(range(0, self.rope, 2)) + list(range(1, self.rope, 2))

    def project(self, x, batch):
        n = x.shape[0]
        q_nope, q_rot = self.query(x)[0].split([self.nope, self.rope], dim=-1)
        k_nope, k_rot, v = self.keys_values(x)
        order = torch.tensor(self._order, device=x.device)
        q = torch.cat([q_rot.index_select(-1, order), q_nope], dim=-1)
        k = torch.cat([k_rot.index_select(-1, order)[:, None, :].expand(n, self.nh, self.rope), k_nope], dim=-1)
        return q, k, v, self.g_proj(x)

    def output(self, x, out, gate):
        n = x.shape[0]
        g = torch.sigmoid(gate.float()).to(out.dtype)
        return self.o_proj((out.view(n, self.nh, self.vd) * g[..., None]).reshape(n, -1))


def _layer(cfg: ModelConfig, i: int, ops, rotary):
    return kimi_linear.DecoderLayer(cfg, i, ops, rotary, full=BailingLatentAttention, linear=BailingDeltaAttention)


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    # the router, and the KDA forget gate's dt_bias and A_log, as transformers keeps them (base.py); the short conv's
    # weights, which transformers also keeps in fp32, stay in the engine's dtype (the conv kernels take one dtype)
    fp32_params = (".gate.weight", ".e_score_correction_bias", ".dt_bias", ".A_log")

    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        CausalLM.__init__(self, cfg, Backbone(cfg, ops, _layer, p.qk_rope_head_dim, p.rope_parameters))
