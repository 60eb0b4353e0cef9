"""Falcon-H1 (`falcon_h1`, TII): in every layer a Mamba2 mixer and RoPE attention run side by side on the same normed
input and their outputs are added, then a SwiGLU MLP:

    x = input_layernorm(h)
    h = h + mamba(x * ssm_in) * ssm_out + attn(x * attn_in) * attn_out
    h = h + feed_forward(pre_ff_layernorm(h))

so a layer has two stateful mixers (`state_mixers`): the Mamba2 mixer under the layer's index i and the attention
under num_layers + i, and a segment entry holds both (T, S and the conv tail for one; position-free keys for the
other). muP multipliers: embeddings, the Mamba2 input and the five parts (z, x, B, C, dt) of its in_proj output, the
attention input, keys and output, the MLP gate (inside the activation) and output, the logits. The Mamba2 output is
a grouped gated RMSNorm (norm before or after the gate) when `mamba_rms_norm`, else y * silu(z). Parameter names are
transformers'."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class FalconGatedNorm(nn.Module):
    """w * rmsnorm_per_group(y), times silu(z) after it (`norm_before_gate`) or y * silu(z) normed; fp32 inside."""

    def __init__(self, dim: int, groups: int, eps: float, before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.before_gate = groups, eps, before_gate

    def forward(self, y, z):
        y = y.float()
        if not self.before_gate:
            y = y * F.silu(z.float())
        g = y.view(*y.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight.float() * g.view_as(y)
        if self.before_gate:
            y = y * F.silu(z.float())
        return y


class FalconMamba2(Mamba2Mixer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        p = cfg.params
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=p.projectors_bias)
        self.norm = (FalconGatedNorm(self.inner, self.groups, cfg.rms_norm_eps, p.mamba_norm_before_gate)
                     if p.mamba_rms_norm else None)
        self.ssm_in = p.ssm_in_multiplier
        gn = self.groups * self.n
        self._mup_parts = tuple(zip((self.inner, self.inner, gn, gn, self.h), p.ssm_multipliers))
        self._mup = {}             # (device, dtype) -> the multiplier per in_proj output column (not a buffer: the
                                   # model may be built on the meta device and its parameters assigned afterwards)

    def mup_vector(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        if key not in self._mup:
            self._mup[key] = torch.cat([torch.full((n,), m, device=like.device, dtype=like.dtype)
                                        for n, m in self._mup_parts])
        return self._mup[key]

    def in_projection(self, x):
        zxbcdt = self.in_proj(x * self.ssm_in)
        return zxbcdt * self.mup_vector(zxbcdt)

    def output(self, x, o, f):
        o = o.reshape(x.shape[0], self.inner)
        y = self.norm(o, f["z"]) if self.norm is not None else o * F.silu(f["z"].float())
        return self.out_proj(y.to(x.dtype))


class FalconAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.key_multiplier = cfg.params.key_multiplier

    def project(self, x, batch):
        q, k, v, extra = super().project(x, batch)
        return q, k * self.key_multiplier, v, extra          # keys scaled before RoPE (RoPE is linear)


class FeedForward(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, multipliers: tuple):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)) * self.down_multiplier


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        self.mamba = FalconMamba2(cfg, i, ops)
        self.self_attn = FalconAttention(cfg, cfg.num_layers + i, ops, rotary)
        self.feed_forward = FeedForward(cfg.hidden_size, p.intermediate_size, p.mlp_bias, p.mlp_multipliers)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ssm_out, self.attn_in, self.attn_out = p.ssm_out_multiplier, p.attention_in_multiplier, \
            p.attention_out_multiplier

    @property
    def state_mixers(self):
        return self.mamba, self.self_attn

    @property
    def state_mixer(self):
        return None

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.input_layernorm(h)
        m = self.mamba(x, batch) * self.ssm_out
        a = self.self_attn(x * self.attn_in, batch) * self.attn_out
        h = batch.kept(h + (m + a))
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim, p.rope_parameters, "final_layernorm"))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.config.params.embedding_multiplier

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return super().head(h, batch) * self.config.params.lm_head_multiplier

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):
            p.copy_(torch.arange(1, p.shape[0] + 1, dtype=p.dtype, device=p.device).log())
        elif name.endswith((".D", "dt_bias")):
            p.fill_(1.0)
        else:
            return False
        return True
