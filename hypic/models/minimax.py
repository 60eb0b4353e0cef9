"""MiniMax-01: lightning attention (scalar decay) layers and softmax attention layers with RoPE,
Mixtral-style MoE in every layer, plain RMSNorms. The residual stream is the *normed* hidden state,
weighted by per-sublayer alpha / beta factors (transformers' MiniMaxDecoderLayer)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import Attention
from ..layers.lightning import LightningAttention
from ..layers.mlp import Experts, Router
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class MixtralMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops = ops
        self.top_k = cfg.params.num_experts_per_tok
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x):
        w, e = self.ops.route(x, self.gate.weight, self.top_k, True)
        return self.ops.experts_forward(x, w, e, self.experts.gate_up_proj, self.experts.down_proj)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == FULL:
            self.self_attn = Attention(cfg, i, ops, rotary)
            self.alpha, self.beta = p.full_attn_alpha_factor, p.full_attn_beta_factor
        else:
            self.self_attn = LightningAttention(cfg, i, ops)
            self.alpha, self.beta = p.linear_attn_alpha_factor, p.linear_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = p.mlp_alpha_factor, p.mlp_beta_factor
        self.mlp = MixtralMoe(cfg, ops)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(h)
        h = batch.kept(h * self.alpha + self.self_attn(h, batch) * self.beta)
        h = self.post_attention_layernorm(h)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim, p.rope_parameters))
