"""Plain decoder-only transformers: Llama (SmolLM2 and the Llama family) and Qwen2 (Qwen2 / Qwen2.5).
Every layer is RoPE attention (GQA) + SwiGLU MLP with plain RMSNorms; the two differ only in their
biases (Qwen2: q/k/v). For PIC this is the hybrid with no linear layer: a segment entry is its
pre-RoPE K/V of tokens [w, L), and the seam window is all that corrects for the segment never
having seen what precedes it. `naive` mode is identical to `pic` here (there is no T to drop).
Qwen2's sliding-window layers (`use_sliding_window`, from `max_window_layers` on) attend to the last
`sliding_window` positions only: the same cached keys, placed by position, under a windowed mask."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.mlp import MLP
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        self.self_attn = Attention(cfg, i, ops, rotary, qkv_bias=p.qkv_bias, o_bias=p.o_bias)
        if i in p.window_layers:                 # Qwen2's sliding-window layers
            self.self_attn.window = p.sliding_window
        self.mlp = MLP(cfg.hidden_size, p.intermediate_size, bias=p.mlp_bias)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.self_attn(self.input_layernorm(h), batch))
        return h + self.mlp(self.post_attention_layernorm(h))


class TransformerForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim, p.rope_parameters))
