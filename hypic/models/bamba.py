"""IBM Bamba (`bamba`): Mamba2 layers with a GQA attention layer here and there (RoPE on the first half of each
head's dims), every layer followed by a SwiGLU MLP; pre-norms (`input_layernorm`, `pre_ff_layernorm`) and a final
`final_layernorm`. Parameter names are transformers'."""

from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer, mamba2_dummy_init
from ..layers.mlp import MLP
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == LINEAR:
            self.mamba = Mamba2Mixer(cfg, i, ops)
        else:
            self.self_attn = Attention(cfg, i, ops, rotary)
        self.feed_forward = MLP(cfg.hidden_size, p.intermediate_size, p.mlp_bias)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.mamba if hasattr(self, "mamba") else self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.state_mixer(self.input_layernorm(h), batch))
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class BambaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.rotary_dim, p.rope_parameters, "final_layernorm"))

    def dummy_init(self, name, p, generator) -> bool:
        return mamba2_dummy_init(name, p, generator)
