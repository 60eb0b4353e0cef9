"""Mamba2 mixer (SSD; Nemotron-H, and the Mamba2 layers of other hybrids): scalar transitions.

in_proj(x) = [gate z (I) | xBC (conv) | dt (H)], I = H * P. A short causal conv (with bias, silu)
runs over x, B and C together; then per head
    h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T        y_t = h_t^T C_t + D x_t
with dt = clamp(softplus(dt + dt_bias), time_step_min, time_step_max) and A = -exp(A_log) (Nemotron-H has no
upper limit; Granite 4.0-H's `time_step_limit` gives both). In fla's layout this
is scalar-decay linear attention with q = C, k = B (n_groups key heads), v = dt * x, g = dt * A:
the state is [H, K = N (d_state), V = P (head_dim)]. The transition acts on the d_state axis, and
being a scalar per head it acts on both (transformers stores the state as [H, P, N], the transpose).
Output: out_proj(grouped RMSNorm(y * silu(z))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compose.transition import Form, log_decay_transitions
from ..config import ModelConfig
from .linear import LinearMixer


class GroupedGatedRMSNorm(nn.Module):
    """w * rmsnorm_per_group(x * silu(gate)), fp32 inside (norm after gate)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x, gate):
        y = x.float() * F.silu(gate.float())
        g = y.view(*y.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(y).to(x.dtype)


class Mamba2Mixer(LinearMixer):
    form = Form.SCALAR

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p = cfg.params
        self.h, self.p_dim, self.n = p.mamba_num_heads, p.mamba_head_dim, p.ssm_state_size
        self.groups = p.n_groups
        self.inner = self.h * self.p_dim
        self.conv_width = p.conv_kernel
        self.dt_min = p.time_step_min
        self.dt_max = p.time_step_max
        hs = cfg.hidden_size
        self.in_proj = nn.Linear(hs, self.inner + self.conv_dim + self.h, bias=p.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim,
                                bias=p.use_conv_bias, padding=self.conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, hs, bias=p.use_bias)

    @property
    def state_shape(self):
        return self.h, self.n, self.p_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.n

    def in_projection(self, x):
        """[z | xBC | dt] of x (a family with muP multipliers scales them here: models/falcon_h1.py)."""
        return self.in_proj(x)

    def features(self, x, batch):
        z, raw, dt = self.in_projection(x).split([self.inner, self.conv_dim, self.h], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)   # [N, H] fp32
        return {"raw": raw, "z": z, "dt": dt, "g": dt * -self.A_log.float().exp()}

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        xs, B, C = conv_out.split([self.inner, self.groups * self.n, self.groups * self.n], dim=-1)
        xs = xs.reshape(-1, self.h, self.p_dim)
        v = xs.float() * f["dt"][idx, :, None]
        fn = self.ops.recurrent_simple_gla if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_simple_gla
        o, final = fn(C.reshape(-1, self.groups, self.n)[None], B.reshape(-1, self.groups, self.n)[None], v[None],
                      f["g"][None, idx], scale=1.0, initial_state=init, output_final_state=True, cu_seqlens=cu)
        o = o[0] + self.D.float()[:, None] * xs.float()                     # D skip on the un-discretised x
        ts = log_decay_transitions(f["g"][idx], cu, Form.SCALAR) if summarize else None
        return o, final, ts

    def output(self, x, o, f):
        n = x.shape[0]
        return self.out_proj(self.norm(o.reshape(n, self.inner), f["z"]).to(x.dtype))


def mamba2_dummy_init(name: str, p: torch.Tensor, generator) -> bool:
    """Random weights of a Mamba2 layer as the reference inits them: A = -(1..H), D = 1, dt = softplus(dt_bias) in
    [1e-3, 1e-1] (log-uniform); False for a parameter that is not one of these."""
    if name.endswith("A_log"):
        p.copy_(torch.arange(1, p.shape[0] + 1, dtype=p.dtype, device=p.device).log())
    elif name.endswith(".D"):
        p.fill_(1.0)
    elif name.endswith("dt_bias"):
        dt = torch.empty(p.shape, device=p.device).uniform_(-6.9078, -2.3026, generator=generator).exp()
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
    else:
        return False
    return True
