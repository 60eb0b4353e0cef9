"""RecurrentGemma (Griffin): recurrent blocks (RG-LRU, layers/rglru.py) and local sliding-window attention (MQA/GQA,
RoPE on half of each head, biased o_proj) in the pattern `block_types` repeats, each followed by a GeGLU MLP with
biases (intermediate_size / 2 wide). Gemma's conventions: zero-centred RMSNorms (x * (1 + w)), embeddings scaled by
sqrt(hidden) rounded to bf16 (transformers keeps that normaliser as a bf16 buffer), tied LM head, logits soft-capped
(tanh(logits / cap) * cap). Parameter names are transformers' (`temporal_block`, `mlp_block`, `final_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.attention import Attention
from ..layers.mlp import activation
from ..layers.norm import RMSNorm
from ..layers.rglru import RGLRUMixer
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class GeGLU(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=True)
        self.up_proj = nn.Linear(hidden, inter, bias=True)
        self.down_proj = nn.Linear(inter, hidden, bias=True)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        self.temporal_pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.layer_types[i] == LINEAR:
            self.temporal_block = RGLRUMixer(cfg, i, ops)
        else:
            self.temporal_block = Attention(cfg, i, ops, rotary, o_bias=True)
            self.temporal_block.window = p.attention_window_size
        self.channel_pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_block = GeGLU(cfg.hidden_size, p.intermediate_size // 2, p.hidden_activation)

    @property
    def state_mixer(self):
        return self.temporal_block

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.temporal_block(self.temporal_pre_norm(h), batch))
        return h + self.mlp_block(self.channel_pre_norm(h))


class RecurrentGemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.rotary_dim, p.rope_parameters,
                                       norm_name="final_norm", norm=norm))
        # sqrt(hidden) as transformers holds it: a bf16 number (50.5 for 2,560, not 50.596)
        self.normalizer = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.bfloat16, device="cpu"))   # (not meta)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        return h * self.normalizer

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cap = self.config.params.logits_soft_cap
        logits = super().head(h, batch)
        return torch.tanh(logits / cap) * cap if cap else logits

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("recurrent_param"):
            # transformers' init: a^c uniform in [0.9^2, 0.999^2] with softplus(Lambda) = -log(a^c) / 2 at c = 1
            u = torch.empty(p.shape, device=p.device).uniform_(0.9 ** 2 + 1e-8, 0.999 ** 2 + 1e-8, generator=generator)
            p.copy_(u.log().mul(0.5).neg().exp().sub(1.0).log())
        elif "norm" in name and p.dim() == 1:
            p.zero_()                                     # zero-centred norms: weight 0 is the identity
        else:
            return False
        return True
