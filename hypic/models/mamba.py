"""State-space models with no attention layer: Mamba (`mamba`), FalconMamba (`falcon_mamba`: Mamba with dt, B and C
RMS-normed without weights) and Mamba2 (`mamba2`): a stack of pre-norm residual blocks, each one mixer. For PIC they
are the degenerate hybrid with no attention: a segment entry is its layers' (T, S, conv tail) alone. The composition
is exact per layer, but above the first layer a cached segment's inputs were computed without its context (as the
keys of an attention layer are in a hybrid), so PIC approximates `full` here too; the seam recomputes the first w
tokens in context. Parameter names are transformers' (`backbone.embeddings`, `backbone.layers.{i}.{norm, mixer}`,
`backbone.norm_f` are mapped by the converter)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.mamba1 import Mamba1Mixer, s4d_dummy_init
from ..layers.mamba2 import Mamba2Mixer, mamba2_dummy_init
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None):
        super().__init__()
        self.norm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(cfg, i, ops) if cfg.arch == "mamba2" else Mamba1Mixer(cfg, i, ops)

    @property
    def state_mixer(self):
        return self.mixer

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return h + self.mixer(self.norm(h), batch)


class MambaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__(cfg, Backbone(cfg, ops, Block))

    def dummy_init(self, name, p, generator) -> bool:
        if self.config.arch == "mamba2":
            return mamba2_dummy_init(name, p, generator)
        return s4d_dummy_init(name, p)
