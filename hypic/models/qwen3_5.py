"""Qwen3.5 (dense and MoE text models) and Qwen3-Next: Gated DeltaNet layers with a gated full
attention layer every few layers, SwiGLU MLP or routed MoE, zero-centred RMSNorms.

One module tree serves the three architectures; parameter names are the Qwen3.5 checkpoint names
(the loader maps Qwen3-Next's fused projections onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import GatedAttention
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import MLP, SparseMoe
from ..layers.norm import RMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        self.is_attention = cfg.layer_types[i] == FULL
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, i, ops, rotary)
        else:
            self.linear_attn = GatedDeltaNet(cfg, i, ops)
        p = cfg.params
        self.mlp = SparseMoe(cfg, ops) if i in p.moe_layers else MLP(cfg.hidden_size, p.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    @property
    def state_mixer(self):
        return self.self_attn if self.is_attention else self.linear_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        m = self.state_mixer(self.input_layernorm(h), batch)
        h, x = self.post_attention_layernorm.add(batch.kept(h), batch.kept(m))      # the residual add with the norm
        return h + self.mlp(x, batch.padding_from(x))


class HybridForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.rotary_dim, p.rope_parameters,
                                       norm=lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):
            p.copy_(uniform(p, 0.01, 16.0, generator).log())
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif "norm" in name and name.endswith("weight"):
            p.zero_()                                  # zero-centred RMSNorm: x / rms(x) * (1 + w)
        else:
            return False
        return True
