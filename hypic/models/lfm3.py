"""LFM3 (`lfm3`, Liquid): LFM2's gated short-conv layers and attention layers of two kinds, sliding-window and full,
each kind with its own RoPE table (the full layers' "proportional" RoPE rotates part of every head's pairs, the rest
at frequency 0), q / k RMSNorm per head and a per-head sigmoid output gate; sandwich norms (`operator_norm` before
the mixer, `post_operator_norm` after it; `ffn_norm` / `post_ffn_norm` around the SwiGLU MLP); the final norm is
`embedding_norm`. Parameter names are transformers'."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import HeadNormAttention
from ..layers.norm import ScaledRMSNorm
from ..layers.rope import Rotary
from ..layers.short_conv import ShortConv
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM
from .lfm2 import FeedForward


class Lfm3Attention(HeadNormAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        p = cfg.params
        self.g_proj = nn.Linear(cfg.hidden_size, self.nh, bias=False) if p.attention_gate else None
        self.window = p.sliding_window if layer_idx in p.window_layers else 0

    def project(self, x, batch):
        q, k, v, _ = super().project(x, batch)
        return q, k, v, (self.g_proj(x) if self.g_proj is not None else None)

    def output(self, x, out, gate):
        n = x.shape[0]
        if gate is not None:
            out = out.view(n, self.nh, self.hd) * torch.sigmoid(gate)[..., None]
        return self.o_proj(out.reshape(n, -1))


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotaries: dict):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == FULL:
            kind = "sliding_attention" if i in p.window_layers else "full_attention"
            self.self_attn = Lfm3Attention(cfg, i, ops, rotaries[kind])
        else:
            self.conv = ShortConv(cfg, i, ops)
        self.feed_forward = FeedForward(cfg.hidden_size, p.intermediate_size)
        self.operator_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if p.sandwich:
            self.post_operator_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_ffn_norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = p.sandwich

    @property
    def state_mixer(self):
        return self.self_attn if hasattr(self, "self_attn") else self.conv

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        y = self.state_mixer(self.operator_norm(h), batch)
        h = batch.kept(h + (self.post_operator_norm(y) if self.sandwich else y))
        y = self.feed_forward(self.ffn_norm(h))
        return h + (self.post_ffn_norm(y) if self.sandwich else y)


class Lfm3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        # one RoPE table per attention kind, each from its own parameters (transformers' init for that layer type)
        rotaries = {t: Rotary(cfg, p.head_dim, dict(items), layer_type=t) for t, items in p.rope_by_type}
        layer = lambda c, i, o, rotary: DecoderLayer(c, i, o, rotaries)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, layer, norm_name="embedding_norm"))
        self.rotaries = list(rotaries.values())         # plain attributes: no parameters
