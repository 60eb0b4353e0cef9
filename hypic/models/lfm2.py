"""LFM2 (Liquid): gated short-conv layers (`ShortConv`, conv window only) and GQA attention with
q/k RMSNorm and RoPE; `operator_norm` before the mixer, `ffn_norm` before the SwiGLU
`feed_forward` (w1 gate, w3 up, w2 down) in every layer; the final norm is `embedding_norm`.
LFM2-MoE (`lfm2_moe`): after its first `num_dense_layers`, `feed_forward` is a MoE with sigmoid routing
(`Lfm2Moe`: `gate`, `experts`, `expert_bias`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import RopeAttention
from ..layers.mlp import Experts, Router
from ..layers.norm import ScaledRMSNorm
from ..layers.short_conv import ShortConv
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class Lfm2Attention(RopeAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(layer_idx, ops, rotary)
        p, hs = cfg.params, cfg.hidden_size
        self.nh, self.num_kv_heads, self.hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        self.key_dim = self.value_dim = self.hd
        self.q_proj = nn.Linear(hs, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=False)
        self.out_proj = nn.Linear(self.nh * self.hd, hs, bias=False)
        self.q_layernorm = ScaledRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_layernorm = ScaledRMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5

    def project(self, x, batch):
        n = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(n, self.nh, self.hd))
        k = self.k_layernorm(self.k_proj(x).view(n, self.num_kv_heads, self.hd))
        return q, k, self.v_proj(x).view(n, self.num_kv_heads, self.hd), None

    def output(self, x, out, extra):
        return self.out_proj(out.reshape(x.shape[0], -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Moe(nn.Module):
    """Sigmoid scores; experts chosen by score + expert_bias (selection only); the chosen scores, renormalised when
    norm_topk_prob (sum + 1e-6, as transformers), times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops, self.p = ops, cfg.params
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.expert_bias = nn.Parameter(torch.zeros(cfg.params.num_experts)) if cfg.params.expert_bias else None

    def forward(self, x):
        p = self.p
        bias = self.expert_bias if self.expert_bias is not None else x.new_zeros(p.num_experts)
        w, e = self.ops.route_grouped_sigmoid(x, self.gate.weight, bias, p.num_experts_per_tok, 1, 1, p.norm_topk_prob,
                                              p.routed_scaling_factor, eps=1e-6)
        return self.ops.experts_forward(x, w.to(x.dtype), e, self.experts.gate_up_proj, self.experts.down_proj)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        if cfg.layer_types[i] == FULL:
            self.self_attn = Lfm2Attention(cfg, i, ops, rotary)
        else:
            self.conv = ShortConv(cfg, i, ops)
        if cfg.arch == "lfm2_moe" and i >= cfg.params.num_dense_layers:
            self.feed_forward = Lfm2Moe(cfg, ops)
        else:
            self.feed_forward = FeedForward(cfg.hidden_size, cfg.params.intermediate_size)
        self.operator_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn if hasattr(self, "self_attn") else self.conv

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.state_mixer(self.operator_norm(h), batch))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim, p.rope_parameters, "embedding_norm"))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("expert_bias"):
            p.zero_()
            return True
        return False
