"""Lara-mini (`lara_mini`): Qwen3.5's Gated DeltaNet layers, and Qwen3-style attention layers (q / k RMSNorm per head)
of two kinds: sliding-window layers with RoPE and full-attention layers with no positional encoding (NoPE, so their
cached keys are used as they are); after every layer a softmax top-k MoE whose router runs in fp32, plus a shared
expert added in full (no gate). Norms multiply in fp32. Parameter names are transformers' (the released fused GDN
`in_proj` [q | k | v | z | b | a] and `out_norm` are split / renamed by the converter)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.attention import HeadNormAttention
from ..layers.gdn import GatedDeltaNet
from ..layers.mlp import MLP, Experts, Router
from ..layers.norm import FP32ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform


class LaraAttention(HeadNormAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        windowed = layer_idx in cfg.params.window_layers
        # the full-attention layers: NoPE; norms multiply in fp32
        super().__init__(cfg, layer_idx, ops, rotary if windowed else None, norm=FP32ScaledRMSNorm)
        self.window = cfg.params.sliding_window if windowed else 0


class LaraMoe(nn.Module):
    """Softmax over every expert from fp32 router logits, the top k (renormalised when norm_topk_prob), plus the
    shared expert in full."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        p = cfg.params
        self.ops, self.top_k, self.norm_topk = ops, p.num_experts_per_tok, p.norm_topk_prob
        self.experts = Experts(cfg)
        self.gate = Router(cfg)
        self.shared_expert = MLP(cfg.hidden_size, p.shared_expert_intermediate_size)

    def forward(self, x):
        w, e = self.ops.route(x.float(), self.gate.weight.float(), self.top_k, self.norm_topk)
        y = self.ops.experts_forward(x, w.to(x.dtype), e, self.experts.gate_up_proj, self.experts.down_proj)
        return y + self.shared_expert(x)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        if cfg.layer_types[i] == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, i, ops)
        else:
            self.self_attn = LaraAttention(cfg, i, ops, rotary)
        self.mlp = LaraMoe(cfg, ops)
        self.input_layernorm = FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.state_mixer(self.input_layernorm(h), batch))
        return h + self.mlp(self.post_attention_layernorm(h))


class LaraMiniForCausalLM(CausalLM):
    fp32_params = (".gate.weight",)              # the router: its logits are fp32 (base.py)

    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        norm = lambda: FP32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.head_dim, p.rope_parameters, norm=norm))

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):                        # transformers' init: A uniform in [0.01, 16]
            p.copy_(uniform(p, 0.01, 16.0, generator).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        else:
            return False
        return True
