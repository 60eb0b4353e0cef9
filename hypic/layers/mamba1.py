"""Mamba (S6) mixer as Jamba, Mamba and FalconMamba use it: diagonal, input-dependent transitions per channel.

in_proj(x) = [x (I) | gate z (I)]; a short causal conv (bias, silu) over x; then
x_proj(x) = [dt (R) | B (N) | C (N)], each RMS-normed (Jamba; FalconMamba without weights; Mamba not at all),
dt = softplus(dt_proj(dt)) [I], and
per channel d with A = -exp(A_log) [I, N]:
    h_t[d, :] = exp(dt_t[d] A[d, :]) * h_{t-1}[d, :] + dt_t[d] x_t[d] B_t        y_t[d] = h_t[d, :] . C_t + D[d] x_t[d]
In fla's layout every channel is a head with K = N and V = 1: q = C and k = B shared by all
heads (one key head), v = dt * x, per-key-channel log decay g[d, n] = dt[d] A[d, n]. The state is
[I, N, 1] and a segment's T is diagonal: exp(sum_t dt_t[d] A[d, n]), an [I, N] array.
Output: out_proj(y * silu(z)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..compose.transition import Form, log_decay_transitions
from ..config import ModelConfig
from .linear import LinearMixer
from .norm import ScaledRMSNorm, UnweightedRMSNorm


def s4d_dummy_init(name: str, p: torch.Tensor) -> bool:
    """A Mamba (S6) layer's A and D as the reference inits them: A[d, n] = -(n + 1) (S4D-real), D = 1; False for
    another parameter."""
    if name.endswith("A_log"):
        p.copy_(torch.arange(1, p.shape[-1] + 1, dtype=p.dtype, device=p.device).log().expand_as(p))
    elif name.endswith(".D"):
        p.fill_(1.0)
    else:
        return False
    return True


class _S6(LinearMixer):
    """What both Mamba (S6) mixers share: I = expand * hidden channels, in_proj to (x, z), a depthwise conv over x,
    a state [I, N, 1] per sequence (every channel a value head), out_proj of y * silu(z)."""

    form = Form.DIAGONAL

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p = cfg.params
        hs = cfg.hidden_size
        self.inner, self.n, self.rank = p.mamba_expand * hs, p.mamba_d_state, p.mamba_dt_rank
        self.conv_width = p.mamba_d_conv
        self.in_proj = nn.Linear(hs, 2 * self.inner, bias=p.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, self.conv_width, groups=self.inner, bias=p.mamba_conv_bias,
                                padding=self.conv_width - 1)

    @property
    def state_shape(self):
        return self.inner, self.n, 1

    @property
    def conv_dim(self) -> int:
        return self.inner

    def output(self, x, o, f):
        return self.out_proj((o * F.silu(f["z"].float())).to(x.dtype))


class Mamba1Mixer(_S6):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        p = cfg.params
        self.x_proj = nn.Linear(self.inner, self.rank + 2 * self.n, bias=False)
        self.dt_proj = nn.Linear(self.rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.n))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=p.mamba_proj_bias)
        # dt, B and C normed: with weights (Jamba), without (FalconMamba), or not at all (Mamba)
        norms = getattr(p, "ssm_norms", "weighted")
        eps = getattr(p, "ssm_norm_eps", cfg.rms_norm_eps)
        for name, dim in (("dt_layernorm", self.rank), ("b_layernorm", self.n), ("c_layernorm", self.n)):
            setattr(self, name, ScaledRMSNorm(dim, eps) if norms == "weighted" else UnweightedRMSNorm(eps)
                    if norms == "weightless" else nn.Identity())

    def features(self, x, batch):
        raw, z = self.in_proj(x).chunk(2, dim=-1)
        return {"raw": raw, "z": z}

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        dt, B, C = self.x_proj(conv_out).split([self.rank, self.n, self.n], dim=-1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.t()
        dt = F.softplus(dt.float() + self.dt_proj.bias.float())                  # [n, I]
        g = dt[:, :, None] * -self.A_log.float().exp()                           # [n, I, N] log decay
        v = (dt * conv_out.float())[..., None]                                    # [n, I, 1]
        q, k = self.c_layernorm(C)[:, None], self.b_layernorm(B)[:, None]        # one key head
        fn = self.ops.recurrent_gla if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_gla
        o, final = fn(q[None], k[None], v[None], g[None], scale=1.0, initial_state=init, output_final_state=True,
                      cu_seqlens=cu)
        o = o[0, :, :, 0] + self.D.float() * conv_out.float()
        ts = log_decay_transitions(g, cu, Form.DIAGONAL) if summarize else None
        return o, final, ts


class MultiHeadMamba1Mixer(_S6):
    """Zamba's Mamba (S6) with `n_mamba_heads` heads: the I channels split into heads of head_dim channels; each head
    has its own x_proj (dt, B and C from its channels) and dt_proj; no dt / B / C norms. in_proj emits (x, z) channel
    pairs, interleaved (transformers' layout, kept as it is). In fla's layout as for Mamba1 (every channel a value head
    with V = 1), with one key head per Mamba head: q = C, k = B of the channel's head; the state is [I, N, 1] and T is
    diagonal. Output: out_proj((y + D x) * silu(z))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        p = cfg.params
        self.heads = p.n_mamba_heads
        self.hd = self.inner // self.heads
        self.x_proj_weight = nn.Parameter(torch.zeros(self.heads, self.rank + 2 * self.n, self.hd))
        self.dt_proj_weight = nn.Parameter(torch.zeros(self.heads, self.hd, self.rank))
        self.dt_proj_bias = nn.Parameter(torch.zeros(self.heads, self.hd))
        self.A_log = nn.Parameter(torch.zeros(self.heads, self.hd, self.n))
        self.D = nn.Parameter(torch.ones(self.heads, self.hd))
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=p.mamba_proj_bias)

    def features(self, x, batch):
        xz = self.in_proj(x).view(x.shape[0], self.inner, 2)
        return {"raw": xz[..., 0], "z": xz[..., 1]}

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        n = conv_out.shape[0]
        ssm = torch.einsum("nhd,hrd->nhr", conv_out.view(n, self.heads, self.hd), self.x_proj_weight)
        dt, B, C = ssm.split([self.rank, self.n, self.n], dim=-1)
        dt = torch.einsum("nhr,hdr->nhd", dt, self.dt_proj_weight).reshape(n, self.inner)
        dt = F.softplus(dt.float() + self.dt_proj_bias.float().reshape(-1))               # [n, I]
        g = dt[:, :, None] * -self.A_log.float().exp().reshape(self.inner, self.n)         # [n, I, N] log decay
        v = (dt * conv_out.float())[..., None]                                              # [n, I, 1]
        fn = self.ops.recurrent_gla if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_gla
        o, final = fn(C[None], B[None], v[None], g[None], scale=1.0, initial_state=init, output_final_state=True,
                      cu_seqlens=cu)
        o = o[0, :, :, 0] + self.D.float().reshape(-1) * conv_out.float()
        ts = log_decay_transitions(g, cu, Form.DIAGONAL) if summarize else None
        return o, final, ts

    @staticmethod
    def dummy_init(cfg: ModelConfig, name: str, p: torch.Tensor, generator) -> bool:
        """As the reference inits them: A = -(1..N) per channel, D = 1, dt = softplus(dt_proj_bias) log-uniform in
        [time_step_min, time_step_max], dt_proj uniform in +-rank^-0.5; False for any other parameter."""
        q = cfg.params
        if name.endswith("A_log"):
            p.copy_(torch.arange(1, p.shape[-1] + 1, dtype=p.dtype, device=p.device).log().expand_as(p))
        elif name.endswith(".D"):
            p.fill_(1.0)
        elif name.endswith("dt_proj_bias"):
            lo, hi = math.log(q.time_step_min), math.log(q.time_step_max)
            dt = torch.empty(p.shape, device=p.device).uniform_(lo, hi, generator=generator).exp()
            dt = dt.clamp(min=q.time_step_floor)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("dt_proj_weight"):
            b = q.mamba_dt_rank ** -0.5
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-b, b, generator=generator))
        else:
            return False
        return True
