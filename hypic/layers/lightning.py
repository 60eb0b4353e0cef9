"""Lightning attention (MiniMax-01; Ring/Ling linear 2.0): linear attention with a fixed decay per
head. Scalar T: a segment of n tokens has T = exp(-slope * n) per head, stored as one number.

Per head the state is [K, V] and S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t (no 1/sqrt(d)
scale). q, k, v = silu(qkv_proj(x)) split per head; output = out_proj(sigmoid(output_gate(x)) *
RMSNorm(o)). Slopes follow ALiBi: base^(h+1) with base = 2^(-8/H), scaled down with depth.

`rope_keys=True` is the RoPE'd variant (Ring-linear applies RoPE to q and k before lightning
attention): the state then carries position phase. A cached segment's state is stored at segment
position 0 and rotated to the segment's start at reuse (`key_rotation`), S' = R(start) S; the scalar
T commutes with the rotation.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compose.transition import Form, log_decay_transitions
from ..config import ModelConfig
from .linear import LinearMixer
from .norm import ScaledRMSNorm


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [H] (transformers' MiniMaxLightningAttention.get_slope_rate)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    return rate * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


def rope_rotation(inv_freq: torch.Tensor, offset: int, dim: int) -> torch.Tensor:
    """[dim, dim] matrix R with R @ x == rotate-half RoPE of x by `offset` positions (fp32)."""
    half = dim // 2
    ang = offset * inv_freq.double()
    cos, sin = ang.cos(), ang.sin()
    r = torch.zeros(dim, dim, dtype=torch.float64)
    i = torch.arange(half)
    r[i, i], r[i, i + half] = cos, -sin
    r[i + half, i], r[i + half, i + half] = sin, cos
    return r.float()


class LightningAttention(LinearMixer):
    form = Form.SCALAR

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, *, rotary=None):
        super().__init__(layer_idx, ops)
        p = cfg.params
        self.h, self.d = p.num_attention_heads, p.head_dim
        hs = cfg.hidden_size
        self.qkv_proj = nn.Linear(hs, 3 * self.h * self.d, bias=False)
        self.output_gate = nn.Linear(hs, self.h * self.d, bias=False)
        self.norm = ScaledRMSNorm(self.h * self.d, p.lightning_norm_eps)
        self.out_proj = nn.Linear(self.h * self.d, hs, bias=False)
        self.slopes = lightning_slopes(self.h, layer_idx, cfg.num_layers)   # fixed, not a parameter
        self.rotary = [rotary] if rotary is not None else None              # RoPE'd keys (Ring-linear)

    @property
    def state_shape(self):
        return self.h, self.d, self.d

    def features(self, x, batch):
        n = x.shape[0]
        qkv = torch.nn.functional.silu(self.qkv_proj(x)).view(n, self.h, 3 * self.d)
        q, k, v = torch.split(qkv, self.d, dim=-1)
        if self.rotary is not None:
            rot = self.rotary[0]
            cos, sin = rot.cos_sin(batch.positions, q.dtype)
            q, k = rot.apply(q, cos, sin), rot.apply(k, cos, sin)
        g = (-self.slopes.to(x.device))[None].expand(n, self.h)                   # [N, H] log decay
        return {"q": q, "k": k, "v": v, "g": g}

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        fn = self.ops.recurrent_simple_gla if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_simple_gla
        o, final = fn(f["q"][None, idx], f["k"][None, idx], f["v"][None, idx], f["g"][None, idx], scale=1.0,
                      initial_state=init, output_final_state=True, cu_seqlens=cu)
        ts = log_decay_transitions(f["g"][idx], cu, Form.SCALAR) if summarize else None
        return o[0], final, ts

    def key_rotation(self, offset: int):
        if self.rotary is None:
            return None
        rot = self.rotary[0]
        r = torch.eye(self.d)
        r[: rot.rotary_dim, : rot.rotary_dim] = rope_rotation(rot.inv_freq.cpu(), offset, rot.rotary_dim)
        return r.to(self.qkv_proj.weight.device)

    def output(self, x, o, f):
        n = x.shape[0]
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.norm(o.reshape(n, self.h * self.d)))
