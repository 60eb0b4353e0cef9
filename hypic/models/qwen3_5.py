"""Qwen3.5 (dense and MoE text models) and Qwen3-Next: Gated DeltaNet layers with a gated full
attention layer every few layers, SwiGLU MLP or routed MoE, zero-centred RMSNorms.

One module tree serves the three architectures; parameter names are the Qwen3.5 checkpoint names
(the loader maps Qwen3-Next's fused projections onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import GatedAttention
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import MLP, SparseMoe
from ..layers.norm import RMSNorm
from ..layers.rope import Rotary
from ..runtime.batch import ForwardBatch


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        self.is_attention = cfg.layer_types[i] == FULL
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, i, ops, rotary)
        else:
            self.linear_attn = GatedDeltaNet(cfg, i, ops)
        self.mlp = SparseMoe(cfg, ops) if i in cfg.moe_layers else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mixer = self.self_attn if self.is_attention else self.linear_attn
        h = h + mixer(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """forward(batch) -> fp32 logits [M, vocab] for the rows batch.logits_index names."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            h = layer(h, batch)
        h = self.model.norm(h[batch.logits_index])
        return self.lm_head(h).float()

    def init_dummy(self, generator: torch.Generator) -> None:
        """Random weights at the real size (benchmarks): normal(0, initializer_range) for matrices,
        the architecture's own init for gates, decays and norms."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            with torch.no_grad():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape, device=p.device).uniform_(0.01, 16.0, generator=generator).log())
                elif name.endswith("dt_bias"):
                    p.fill_(1.0)
                elif name.endswith("linear_attn.norm.weight"):
                    p.fill_(1.0)
                elif "norm" in name and leaf == "weight":
                    p.zero_()
                elif name.endswith("conv1d.weight"):
                    bound = 1.0 / p.shape[-1] ** 0.5
                    p.copy_(torch.empty(p.shape, device=p.device).uniform_(-bound, bound, generator=generator))
                else:
                    p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=generator))
