"""Kimi-Linear: KDA linear layers with an MLA (NoPE) layer every few layers, a dense MLP on the first
layers and a DeepSeek-style MoE (sigmoid grouped routing, shared experts) elsewhere, plain RMSNorms.
Parameter names are transformers' KimiLinear names (the converter maps checkpoint names onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.kda import KimiDeltaAttention
from ..layers.mla import MultiHeadLatentAttention
from ..layers.mlp import MLP, Experts
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform


class KimiRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.params.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.params.num_experts))


class KimiMoe(nn.Module):
    """DeepSeek-V3 routing (sigmoid scores, grouped top-k with a correction bias) over SwiGLU experts, plus shared
    experts; `limit`: every SwiGLU's inputs clamped (GLM-5 Next)."""

    def __init__(self, cfg: ModelConfig, ops, limit: float | None = None):
        super().__init__()
        p = self.p = cfg.params
        self.ops, self.limit = ops, limit
        self.gate = KimiRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, p.moe_intermediate_size * p.num_shared_experts, limit=limit)

    def forward(self, x, rows=None):
        """rows: the rows from it on are padding, which no routed expert takes (layers/mlp.py SparseMoe)."""
        p = self.p
        w, e = self.ops.route_grouped_sigmoid(x, self.gate.weight, self.gate.e_score_correction_bias,
                                              p.num_experts_per_tok, p.n_group, p.topk_group, p.norm_topk_prob,
                                              p.routed_scaling_factor)
        y = self.ops.experts_forward(x, w, e, self.experts.gate_up_proj, self.experts.down_proj, self.limit, rows=rows)
        return y + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """full / linear: the mixers' constructors, (cfg, layer index, ops[, rotary]) -> mixer (Ling 3.0 passes its own;
    Kimi-Linear's MLA is NoPE: rotary None)."""
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)


    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None, full=MultiHeadLatentAttention,
                 linear=KimiDeltaAttention):
        super().__init__()
        p = cfg.params
        self.self_attn = full(cfg, i, ops, rotary) if cfg.layer_types[i] == FULL else linear(cfg, i, ops)
        self.mlp = KimiMoe(cfg, ops) if i in p.moe_layers else MLP(cfg.hidden_size, p.intermediate_size)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.self_attn(self.input_layernorm(h), batch))
        x = self.post_attention_layernorm(h)
        return h + self.mlp(x, batch.padding_from(x))


class KimiLinearForCausalLM(CausalLM):
    # the router, and KDA's dt_bias (transformers' _keep_in_fp32_modules_strict; base.py)
    fp32_params = (".gate.weight", ".e_score_correction_bias", ".dt_bias")

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):                      # fla's init: A in [1, 16]
            p.copy_(uniform(p, 1.0, 16.0, generator).log())
        elif name.endswith("dt_bias"):                  # inverse softplus of dt in [1e-3, 1e-1]
            dt = uniform(p, -6.9078, -2.3026, generator).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("e_score_correction_bias"):
            p.zero_()
        else:
            return False
        return True
