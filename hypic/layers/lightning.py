"""Lightning attention: linear attention with a fixed decay per head, scalar T. A segment of n
tokens has T = exp(-slope * n) per head, stored as one number.

Two layers share the kernel (`SimpleGlaMixer`): per head the state is [K, V],
S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t.

- `LightningAttention` (MiniMax-01): q, k, v = silu(qkv_proj(x)) split per head, no scale;
  output = out_proj(sigmoid(output_gate(x)) * RMSNorm(o)); slopes as transformers' MiniMax.
  `rotary=` gives a RoPE'd-key variant of this layout (a test vehicle for the state rotation).
- `BailingLinearAttention` (Ring-linear / Ling-linear 2.0, `bailing_moe_linear`): fused
  `query_key_value` (optionally silu), per-head q/k RMSNorm, partial rotate-half RoPE on q and k at
  the absolute position, q scaled by head_dim^-0.5; output = dense(g_norm(o) * sigmoid(g_proj(x)))
  with a group RMSNorm; slopes as SGLang / vLLM compute them (`ring_slopes`).

RoPE'd keys make the state carry position phase. A cached segment's state is stored at segment
position 0 and rotated to the segment's start at reuse (`key_rotation`), S' = R(start) S; the
scalar T commutes with the rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..compose.transition import Form, log_decay_transitions
from ..config import ModelConfig
from .linear import LinearMixer
from .norm import ScaledRMSNorm


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Per-head decay rates [H] (transformers' MiniMaxLightningAttention.get_slope_rate)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32, device="cpu") + 1)    # (not meta: moved at first use)
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


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes [H]: 2^(-8/n)^(h+1) for a power of two n; otherwise the slopes of the largest
    power of two p < H, then every other slope of the 2p schedule (SGLang / vLLM _build_slope_tensor)."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_2(num_heads)
    else:
        p = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_2(p) + alibi_slopes(2 * p).tolist()[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")          # (not meta: moved at first use)


def ring_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Ring-linear decay rates [H]: ALiBi slopes * (1 - layer_idx / (L - 1) + 1e-5), layer_idx the
    global index (SGLang's and vLLM's BailingMoELinearAttention; MLX-LM and the Ring-2.5 ports use
    layer_idx - 1 instead, see docs/algorithm.md section 11)."""
    base = alibi_slopes(num_heads)
    if num_layers <= 1:
        return base * (1 + 1e-5)
    return base * (1 - layer_idx / (num_layers - 1) + 1e-5)


class SimpleGlaMixer(LinearMixer):
    """The lightning kernel and state rotation shared by the lightning layers. A subclass sets
    self.h, self.d (heads, head dim), self.slopes [H], self.rotary ([Rotary] or None), and writes
    `features` returning q (scale folded in), k, v [N, H, D] and g [N, H] (log decay)."""

    form = Form.SCALAR
    rotary = None

    @property
    def state_shape(self):
        return self.h, self.d, self.d

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        fn = self.ops.recurrent_simple_gla if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_simple_gla
        o, final = fn(f["q"][None, idx], f["k"][None, idx], f["v"][None, idx], f["g"][None, idx], scale=1.0,
                      initial_state=init, output_final_state=True, cu_seqlens=cu)
        ts = log_decay_transitions(f["g"][idx], cu, Form.SCALAR) if summarize else None
        return o[0], final, ts

    def key_rotation(self, offset: int):
        """[D, D]: RoPE by `offset` on the first rotary_dim key channels, identity on the rest."""
        if self.rotary is None:
            return None
        rot = self.rotary[0]
        r = torch.eye(self.d)
        r[: rot.rotary_dim, : rot.rotary_dim] = rope_rotation(rot.inv_freq.cpu(), offset, rot.rotary_dim)
        return r.to(next(self.parameters()).device)

    def _decay(self, n: int, device) -> torch.Tensor:
        if self.slopes.device != torch.device(device):     # moved once: a copy per call would also
            self.slopes = self.slopes.to(device)          # break CUDA-graph capture of the decode step
        return (-self.slopes)[None].expand(n, self.h)                             # [N, H] log decay


class LightningAttention(SimpleGlaMixer):
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

    def features(self, x, batch):
        n = x.shape[0]
        qkv = torch.nn.functional.silu(self.qkv_proj(x)).view(n, self.h, 3 * self.d)
        q, k, v = torch.split(qkv, self.d, dim=-1)
        if self.rotary is not None:
            rot = self.rotary[0]
            cos, sin = rot.cos_sin(batch.positions, q.dtype)
            q, k = rot.apply(q, cos, sin), rot.apply(k, cos, sin)
        return {"q": q, "k": k, "v": v, "g": self._decay(n, x.device)}

    def output(self, x, o, f):
        n = x.shape[0]
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.norm(o.reshape(n, self.h * self.d)))


class GroupRMSNorm(nn.Module):
    """w * x / rms(x), the rms taken within each of `groups` equal slices of the last axis (fp32 inside)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (self.groups, -1))
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (self.weight.float() * y).to(x.dtype)


class BailingLinearAttention(SimpleGlaMixer):
    """Ring-linear / Ling-linear 2.0 lightning layer. Parameter names are the checkpoint's
    (`model.layers.{i}.attention.*`): query_key_value [3·H·D, hidden] (q heads, then k, then v),
    query_layernorm / key_layernorm [D] (use_qk_norm), g_proj [H·D, hidden], g_norm [H·D], dense."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(layer_idx, ops)
        p = cfg.params
        self.h, self.d = p.num_attention_heads, p.head_dim
        hs, inner = cfg.hidden_size, p.num_attention_heads * p.head_dim
        self.silu = p.linear_silu
        self.query_key_value = nn.Linear(hs, 3 * inner, bias=p.qkv_bias)
        if p.use_qk_norm:
            self.query_layernorm = ScaledRMSNorm(self.d, cfg.rms_norm_eps)
            self.key_layernorm = ScaledRMSNorm(self.d, cfg.rms_norm_eps)
        self.g_proj = nn.Linear(hs, inner, bias=False)
        self.g_norm = GroupRMSNorm(inner, p.group_norm_size, cfg.rms_norm_eps)
        self.dense = nn.Linear(inner, hs, bias=p.dense_bias)
        self.slopes = ring_slopes(self.h, layer_idx, cfg.num_layers)     # fixed, not a parameter
        self.rotary = [rotary]                                           # shared module, not a child
        self.scale = self.d ** -0.5

    def features(self, x, batch):
        n = x.shape[0]
        qkv = self.query_key_value(x)
        if self.silu:
            qkv = torch.nn.functional.silu(qkv)
        q, k, v = qkv.view(n, 3, self.h, self.d).unbind(1)
        if hasattr(self, "query_layernorm"):
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        rot = self.rotary[0]
        cos, sin = rot.cos_sin(batch.positions, q.dtype)
        q, k = rot.apply(q, cos, sin), rot.apply(k, cos, sin)
        return {"q": q * self.scale, "k": k, "v": v, "g": self._decay(n, x.device)}

    def output(self, x, o, f):
        n = x.shape[0]
        return self.dense(self.g_norm(o.reshape(n, self.h * self.d)) * torch.sigmoid(self.g_proj(x)))
