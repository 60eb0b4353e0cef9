"""GLM-5 Next (text): KDA layers and, every fourth layer, NoPE MLA reading the keys a DSA indexer selects
(layers/indexed.py); `hc_mult` residual streams with manifold-constrained hyper-connections (mHC): before each block
the streams' flat features (unweighted RMS norm) give per token a collapse weight per stream (pre), an expansion weight
per stream (post) and a stream-mixing matrix (comb, made doubly stochastic by Sinkhorn iterations); the block reads
the collapsed streams through its pre-norm, and the new streams are post * block output + comb^T @ streams. The LM
head reads the streams' plain mean through the final norm. Dense MLPs on the first layers, a DeepSeek-V3 MoE after,
both with clamped SwiGLU (`swiglu_limit`). Parameter names are transformers' (`attn_hc`, `ffn_hc`, `self_attn` for
both mixers); the multimodal checkpoint's vision tower is dropped at load."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FULL, ModelConfig
from ..layers.indexed import IndexedLatentAttention
from ..layers.kda import ForgetGate, KimiDeltaAttention, head_rate_log_decay
from ..layers.mlp import MLP
from ..layers.norm import ScaledRMSNorm, UnweightedRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform
from .kimi_linear import KimiMoe


class BoundedForgetGate(ForgetGate):
    """Kimi's low-rank forget gate with one A_log per head and, where the config bounds it, log decay
    lb * sigmoid(exp(A_log) * (f + dt_bias)) (else Kimi's -exp(A_log) * softplus(f + dt_bias))."""

    def __init__(self, hidden: int, heads: int, head_dim: int, lower_bound: float | None):
        super().__init__(hidden, heads, head_dim)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.lower_bound = lower_bound

    def forward(self, x):
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        return head_rate_log_decay(g, self.A_log, self.lower_bound)


class GlmDeltaAttention(KimiDeltaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        p = cfg.params
        self.forget_gate = BoundedForgetGate(cfg.hidden_size, self.h, self.d, p.linear_lower_bound)


class HyperConnection(nn.Module):
    """One mHC: streams h [N, n * H] -> (post [N, n], comb [N, n, n] fp32, the collapsed block input [N, H])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        p = cfg.params
        self.n, self.hidden, self.eps, self.iters = p.hc_mult, cfg.hidden_size, p.hc_eps, p.hc_sinkhorn_iters
        self.input_norm = UnweightedRMSNorm(cfg.rms_norm_eps)
        self.fn = nn.Parameter(torch.zeros((2 + self.n) * self.n, self.n * self.hidden))
        self.base = nn.Parameter(torch.zeros((2 + self.n) * self.n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h):
        n, eps = self.n, self.eps
        f = F.linear(self.input_norm(h.float()), self.fn.float())
        pre_w, post_w, comb_w = f.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        streams = h.unflatten(-1, (n, self.hidden))
        collapsed = (pre[..., None] * streams).sum(1).to(h.dtype)
        return post, comb, collapsed

    def combine(self, h, y, post, comb):
        """post * y into every stream plus comb^T @ streams (the block's output expanded, the streams mixed)."""
        dt = h.dtype
        streams = h.unflatten(-1, (self.n, self.hidden))
        out = post.to(dt)[..., None] * y[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
        return out.flatten(1)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary=None):
        super().__init__()
        p = cfg.params
        self.self_attn = IndexedLatentAttention(cfg, i, ops) if cfg.layer_types[i] == FULL else GlmDeltaAttention(
            cfg, i, ops)
        self.mlp = (KimiMoe(cfg, ops, p.swiglu_limit) if i in p.moe_layers
                    else MLP(cfg.hidden_size, p.intermediate_size, limit=p.swiglu_limit))
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    @property
    def state_mixers(self):
        if isinstance(self.self_attn, IndexedLatentAttention):
            return (self.self_attn, self.self_attn.indexer)
        return (self.self_attn,)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        post, comb, z = self.attn_hc(h)
        h = batch.kept(self.attn_hc.combine(h, self.self_attn(self.input_layernorm(z), batch), post, comb))
        post, comb, z = self.ffn_hc(h)
        return self.ffn_hc.combine(h, self.mlp(self.post_attention_layernorm(z)), post, comb)


class StreamMeanNorm(ScaledRMSNorm):
    """The final norm, on the plain mean of the streams (transformers' HyperHead, then `norm`)."""

    def __init__(self, dim: int, eps: float, streams: int):
        super().__init__(dim, eps)
        self.streams = streams

    def forward(self, h):
        return super().forward(h.unflatten(-1, (self.streams, -1)).mean(1))


class Glm5NextForCausalLM(CausalLM):
    # kept fp32 as transformers keeps them (_keep_in_fp32_modules_strict; the conv is not: our conv ops take one dtype)
    fp32_params = (".gate.weight", ".e_score_correction_bias", ".dt_bias", ".A_log", "_hc.base", "_hc.scale")

    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer,
                                       norm=lambda: StreamMeanNorm(cfg.hidden_size, cfg.rms_norm_eps, p.hc_mult)))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids).repeat(1, self.config.params.hc_mult)   # every stream alike

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):                        # transformers' init: zeros with the bounded gate
            if self.config.params.linear_lower_bound is not None:
                p.zero_()
            else:
                p.copy_(uniform(p, 1.0, 16.0, generator).log())
        elif name.endswith("dt_bias"):                    # inverse softplus of dt in [1e-3, 1e-1]
            dt = uniform(p, -6.9078, -2.3026, generator).exp()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith(("e_score_correction_bias", "_hc.base", "compress_ape", "k_norm.bias")):
            p.zero_()
        elif name.endswith(("_hc.scale", "compress_gate", "k_norm.weight")):
            p.fill_(1.0)
        else:
            return False
        return True
