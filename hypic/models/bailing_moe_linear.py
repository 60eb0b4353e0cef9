"""Ring-linear / Ling-linear 2.0 (`bailing_moe_linear`, checkpoints declare
`BailingMoeLinearV2ForCausalLM`; remote code, not in transformers).

Pre-norm blocks `h + attention(norm(h))`, `h + mlp(norm(h))`. Every `layer_group_size`-th layer is
GQA softmax attention, the others lightning attention with RoPE'd keys (`BailingLinearAttention`).
Both kinds read a fused `query_key_value`, optional per-head q/k RMSNorm and partial rotate-half
RoPE, and project out through `dense`. Layers before `first_k_dense_replace` have a SwiGLU MLP,
the others a MoE: sigmoid (or softmax) scores, an optional selection-only expert bias, grouped
top-k, weights renormalised and scaled by `routed_scaling_factor`, plus ungated shared experts.

Module names follow the checkpoint (`attention`, `mlp.gate`, `mlp.shared_experts`), except
`model.word_embeddings` -> `model.embed_tokens` and the per-expert tensors, fused at load
(`models/convert.py: bailing_moe_linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.attention import RopeAttention
from ..layers.lightning import BailingLinearAttention
from ..layers.mlp import MLP, Experts, Router
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM


class BailingAttention(RopeAttention):
    """GQA softmax attention: query_key_value [(H + 2·Hkv)·D, hidden], q/k RMSNorm per head before
    partial RoPE, scale D^-0.5, dense out. Cached keys are the normed, un-rotated ones."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(layer_idx, ops, rotary)
        p = cfg.params
        self.nh, self.num_kv_heads, self.hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        self.key_dim = self.value_dim = self.hd
        hs = cfg.hidden_size
        self.query_key_value = nn.Linear(hs, (self.nh + 2 * self.num_kv_heads) * self.hd, bias=p.qkv_bias)
        if p.use_qk_norm:
            self.query_layernorm = ScaledRMSNorm(self.hd, cfg.rms_norm_eps)
            self.key_layernorm = ScaledRMSNorm(self.hd, cfg.rms_norm_eps)
        self.dense = nn.Linear(self.nh * self.hd, hs, bias=p.dense_bias)
        self.scale = self.hd ** -0.5

    def project(self, x, batch):
        n = x.shape[0]
        q, k, v = self.query_key_value(x).view(n, -1, self.hd).split([self.nh, self.num_kv_heads, self.num_kv_heads], 1)
        if hasattr(self, "query_layernorm"):
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        return q, k, v, None

    def output(self, x, out, extra):
        return self.dense(out.reshape(x.shape[0], -1))


class BailingMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops, p = ops, cfg.params
        self.p = p
        self.gate = Router(cfg)
        if p.expert_bias:
            self.gate.expert_bias = nn.Parameter(torch.zeros(p.num_experts))
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, p.shared_intermediate_size) if p.shared_intermediate_size else None

    def route(self, x):
        p = self.p
        if p.score_function == "sigmoid":
            bias = self.gate.expert_bias if p.expert_bias else torch.zeros(p.num_experts, device=x.device)
            groups, topk_groups = (p.n_group, p.topk_group) if p.n_group > 1 else (1, 1)
            w, e = self.ops.route_grouped_sigmoid(x, self.gate.weight, bias, p.num_experts_per_tok, groups,
                                                  topk_groups, p.norm_topk_prob, p.routed_scaling_factor)
            return w.to(x.dtype), e
        w, e = self.ops.route(x, self.gate.weight.to(x.dtype), p.num_experts_per_tok, p.norm_topk_prob)  # softmax
        return w * p.routed_scaling_factor, e

    def forward(self, x):
        w, e = self.route(x)
        y = self.ops.experts_forward(x, w, e, self.experts.gate_up_proj, self.experts.down_proj)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == FULL:
            self.attention = BailingAttention(cfg, i, ops, rotary)
        else:
            self.attention = BailingLinearAttention(cfg, i, ops, rotary)
        self.mlp = BailingMoe(cfg, ops) if i in p.moe_layers else MLP(cfg.hidden_size, p.intermediate_size)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.attention

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = batch.kept(h + self.attention(self.input_layernorm(h), batch))
        return h + self.mlp(self.post_attention_layernorm(h))


class BailingMoeLinearForCausalLM(CausalLM):
    fp32_params = (".gate.weight", ".e_score_correction_bias", ".gate.expert_bias")       # the router (base.py)

    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.rotary_dim, p.rope_parameters))
