"""Nemotron-H: a stack of single-mixer blocks, each Mamba2, attention (NoPE, GQA) or a squared-ReLU
MLP, with pre-norm and a residual. Parameter names are transformers' (`backbone.` in original
checkpoints is mapped to `model.` by the converter)."""

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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None):
        super().__init__()
        p = cfg.params
        self.norm = FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kind = cfg.layer_types[i]
        if kind == LINEAR:
            self.mixer = Mamba2Mixer(cfg, i, ops)
        elif kind == FULL:
            self.mixer = Attention(cfg, i, ops, None)
        else:
            self.mixer = Relu2MLP(cfg.hidden_size, p.intermediate_size, p.mlp_bias)
        self.stateful = kind in (LINEAR, FULL)

    @property
    def state_mixer(self):
        return self.mixer if self.stateful else None

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return h + self.mixer(self.norm(h), batch)


class NemotronHForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        norm = lambda: FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, Block, norm=norm))

    def dummy_init(self, name, p, generator) -> bool:
        return mamba2_dummy_init(name, p, generator)
