"""Jamba: Mamba (S6) layers with an attention layer (NoPE, GQA) every `attn_layer_period` layers,
SwiGLU MLP or a softmax top-k MoE (weights not renormalised) every `expert_layer_period` layers,
plain RMSNorms. Parameter names are transformers' Jamba names."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import Attention
from ..layers.mamba1 import Mamba1Mixer, s4d_dummy_init
from ..layers.mlp import MLP, TopKMoe
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == FULL:
            self.self_attn = Attention(cfg, i, ops, None)
        else:
            self.mamba = Mamba1Mixer(cfg, i, ops)
        self.feed_forward = TopKMoe(cfg, ops, False) if i in p.moe_layers else MLP(cfg.hidden_size, p.intermediate_size)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn if hasattr(self, "self_attn") else self.mamba

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.state_mixer(self.input_layernorm(h), batch))
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class JambaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, norm_name="final_layernorm"))

    def dummy_init(self, name, p, generator) -> bool:
        return s4d_dummy_init(name, p)
