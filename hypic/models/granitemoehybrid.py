"""IBM Granite 4.0-H (`granitemoehybrid`): Mamba2 layers with an attention layer here and there (NoPE in
the released models; RoPE when `position_embedding_type` is "rope"), every layer followed by a shared
SwiGLU MLP and, in the MoE models, a top-k MoE whose weights are a softmax over the chosen k logits.
muP multipliers: embeddings x `embedding_multiplier`, each residual branch x `residual_multiplier`,
attention scores x `attention_multiplier` (instead of 1/sqrt(head_dim)), logits / `logits_scaling`.
Parameter names are transformers' (the original checkpoints' `input_linear` / `output_linear` /
`router.layer` expert names are mapped by the converter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer, mamba2_dummy_init
from ..layers.mlp import TopKMoe
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class SharedMLP(nn.Module):
    """input_linear emits [gate | up] (gate rows first), output_linear maps back."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == LINEAR:
            self.mamba = Mamba2Mixer(cfg, i, ops)
        else:
            self.self_attn = Attention(cfg, i, ops, rotary)
            self.self_attn.scale = p.attention_multiplier
        self.shared_mlp = SharedMLP(cfg.hidden_size, p.shared_intermediate_size)
        # softmax over the top-k logits = the full softmax renormalised over the k chosen
        self.block_sparse_moe = TopKMoe(cfg, ops, True) if p.num_experts > 0 else None
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = p.residual_multiplier

    @property
    def state_mixer(self):
        return self.mamba if hasattr(self, "mamba") else self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.state_mixer(self.input_layernorm(h), batch) * self.residual_multiplier)
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x) + y
        return h + y * self.residual_multiplier


class GraniteMoeHybridForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim if p.rope_parameters else 0,
                                       p.rope_parameters))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.config.params.embedding_multiplier

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return super().head(h, batch) / self.config.params.logits_scaling

    def dummy_init(self, name, p, generator) -> bool:
        return mamba2_dummy_init(name, p, generator)
