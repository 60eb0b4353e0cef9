"""OLMo-Hybrid (`olmo_hybrid`, AllenAI): Gated DeltaNet layers and OLMo 3 attention layers with a SwiGLU MLP
after each. The two kinds of layer differ in where their norms sit:

    linear     h += gdn(input_layernorm(h));       h += mlp(post_attention_layernorm(h))      (pre-norm)
    attention  h += post_attention_layernorm(attn(h)); h += post_feedforward_layernorm(mlp(h))  (post-norm)

The attention's q / k RMSNorms span all heads at once (before the heads are split); RoPE when the config has a
rope_theta, else NoPE. The GDN layer is Qwen3.5's recurrence with separate q / k / v / a / b / g projections,
no conv bias, a gated output norm with eps 1e-5, and beta scaled to [0, 2] (`linear_allow_neg_eigval`: the
transition I - beta k k^T may then have a negative eigenvalue; T composes the same way). Parameter names are
transformers'."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..layers.joined import JoinedWeights
from ..layers.mlp import MLP
from ..layers.norm import FP32ScaledRMSNorm, RMSNormGated
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform

O_NORM_EPS = 1e-5                       # transformers' OlmoHybridGatedDeltaNet fixes it (not rms_norm_eps)


class OlmoGatedDeltaNet(GatedDeltaNet):
    def projections(self, cfg: ModelConfig, ops) -> None:
        hs = cfg.hidden_size
        self.q_proj = nn.Linear(hs, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hs, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hs, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hs, self.hv, bias=False)
        self.b_proj = nn.Linear(hs, self.hv, bias=False)
        self.g_proj = nn.Linear(hs, self.value_dim, bias=False)
        self.recurrence_params()
        self.o_proj = nn.Linear(self.value_dim, hs, bias=False)
        self.o_norm = RMSNormGated(self.dv, O_NORM_EPS, ops)
        self.beta_scale = 2.0 if cfg.params.allow_neg_eigval else 1.0
        self._qkv, self._ab = JoinedWeights(), JoinedWeights()

    def joined_parts(self) -> list:
        """q | k | v and b | a packed at load time (layers/joined.py pack_model): the joins without their copies."""
        return [(self._qkv, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                (self._ab, [self.b_proj.weight, self.a_proj.weight])]

    def features(self, x, batch):
        # q | k | v (the conv's input, in the order of the conv's channels) by one GEMM, b and a by another
        raw = F.linear(x, self._qkv.weight(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        if raw.shape[-1] != self.conv_dim:                 # the joined matrix's zero padding rows
            raw = raw[..., : self.conv_dim]
        b, a = self._ab.linear(x, self.b_proj.weight, self.a_proj.weight)
        g, beta = self.ops.gdn_gate_beta(a, b, self.A_log, self.dt_bias)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        return {"raw": raw, "z": self.g_proj(x), "g": g, "beta": beta}

    def output(self, x, o, f):
        z = f["z"].reshape(-1, self.dv)
        return self.o_proj(self.o_norm(o.reshape(-1, self.dv), z).reshape(x.shape[0], self.value_dim))


class OlmoAttention(Attention):
    """OLMo 3: q / k RMSNorm over all heads at once, before the heads are split."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.q_norm = FP32ScaledRMSNorm(self.nh * self.hd, cfg.rms_norm_eps)
        self.k_norm = FP32ScaledRMSNorm(self.num_kv_heads * self.hd, cfg.rms_norm_eps)

    def project(self, x, batch):
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(n, self.nh, self.hd)
        k = self.k_norm(self.k_proj(x)).view(n, self.num_kv_heads, self.hd)
        return q, k, self.v_proj(x).view(n, self.num_kv_heads, self.hd), None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        hs, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mlp = MLP(hs, cfg.params.intermediate_size)
        self.post_attention_layernorm = FP32ScaledRMSNorm(hs, eps)
        self.linear = cfg.layer_types[i] == LINEAR
        if self.linear:
            self.linear_attn = OlmoGatedDeltaNet(cfg, i, ops)
            self.input_layernorm = FP32ScaledRMSNorm(hs, eps)
        else:
            self.self_attn = OlmoAttention(cfg, i, ops, rotary)
            self.post_feedforward_layernorm = FP32ScaledRMSNorm(hs, eps)

    @property
    def state_mixer(self):
        return self.linear_attn if self.linear else self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.linear:
            h = h + self.linear_attn(self.input_layernorm(h), batch)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(h, batch))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class OlmoHybridForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        norm = lambda: FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim if p.rope_parameters else 0,
                                       p.rope_parameters, norm=norm))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):                        # transformers' init: A uniform in [0, 16]
            p.copy_(uniform(p, 0.01, 16.0, generator).log())
        elif name.endswith("dt_bias"):                    # inverse softplus of dt in [1e-3, 1e-1]
            dt = uniform(p, -6.9078, -2.3026, generator).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            return False
        return True
