"""Nemotron-H: a stack of single-mixer blocks, each Mamba2, attention (NoPE, GQA), a squared-ReLU
MLP or (Nemotron 3) a MoE of squared-ReLU experts with a shared expert, with pre-norm and a residual.
Parameter names are transformers' (`backbone.` in original checkpoints is mapped to `model.` by the
converter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FULL, LINEAR, ModelConfig
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer, mamba2_dummy_init
from ..layers.norm import FP32ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class Relu2MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x, batch=None):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronMoe(nn.Module):
    """Sigmoid scores; experts chosen by score + `e_score_correction_bias` within the best `topk_group` of `n_group`
    groups; the chosen scores (renormalised when norm_topk_prob) times routed_scaling_factor weigh non-gated relu²
    experts, run in a latent space when `moe_latent_size` (fc1 / fc2 latent projections around them); plus a relu²
    shared expert on the block's input."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        p = cfg.params
        self.ops, self.p = ops, p
        d = p.moe_latent_size or cfg.hidden_size
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(p.num_experts, cfg.hidden_size))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(p.num_experts))
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.empty(p.num_experts, p.moe_intermediate_size, d))
        self.experts.down_proj = nn.Parameter(torch.empty(p.num_experts, d, p.moe_intermediate_size))
        self.shared_experts = Relu2MLP(cfg.hidden_size, p.moe_shared_intermediate_size, p.mlp_bias)
        if p.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, p.moe_latent_size, bias=p.mlp_bias)
            self.fc2_latent_proj = nn.Linear(p.moe_latent_size, cfg.hidden_size, bias=p.mlp_bias)

    def forward(self, x, batch=None):
        p = self.p
        w, e = self.ops.route_grouped_sigmoid(x, self.gate.weight, self.gate.e_score_correction_bias,
                                              p.num_experts_per_tok, p.n_group, p.topk_group, p.norm_topk_prob,
                                              p.routed_scaling_factor)
        h = self.fc1_latent_proj(x) if p.moe_latent_size else x
        y = self.ops.experts_forward_plain(h, w.to(h.dtype), e, self.experts.up_proj, self.experts.down_proj)
        if p.moe_latent_size:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class Block(nn.Module):
    cuts_rows = True                  # the last block, if an MLP, on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None):
        super().__init__()
        p = cfg.params
        self.norm = FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kind = cfg.layer_types[i]
        if kind == LINEAR:
            self.mixer = Mamba2Mixer(cfg, i, ops)
        elif kind == FULL:
            self.mixer = Attention(cfg, i, ops, None)
        elif i in p.moe_layers:
            self.mixer = NemotronMoe(cfg, ops)
        else:
            self.mixer = Relu2MLP(cfg.hidden_size, p.intermediate_size, p.mlp_bias)
        self.stateful = kind in (LINEAR, FULL)

    @property
    def state_mixer(self):
        return self.mixer if self.stateful else None

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self.stateful:
            h = batch.kept(h)
        return h + self.mixer(self.norm(h), batch)


class NemotronHForCausalLM(CausalLM):
    fp32_params = (".gate.weight", ".e_score_correction_bias", ".gate.expert_bias")       # the router (base.py)

    def __init__(self, cfg: ModelConfig, ops):
        norm = lambda: FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, Block, norm=norm))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("e_score_correction_bias"):
            p.zero_()
            return True
        return mamba2_dummy_init(name, p, generator)
