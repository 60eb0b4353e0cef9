"""Kimi Delta Attention (Kimi-Linear): the delta rule with a decay per key channel. Dense T.

Per head the state is [K, V] and S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
so a segment's T is a dense K x K matrix per head (appended-identity trick). q, k, v each pass a
short causal conv (one conv over their concatenation here; checkpoints store q/k/v_conv1d).
Parameter names follow transformers' KimiLinearDeltaAttention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compose.transition import Form, augment
from ..config import ModelConfig
from .linear import LinearMixer, dense_summary_kernel
from .norm import SigmoidGatedRMSNorm


def head_rate_log_decay(f: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log decay from a gate input f [N, H, K] (fp32) with one rate exp(A_log) per head (A_log [H]):
    lower_bound * sigmoid(rate * f) (the bounded "safe" gate of Ling 3.0 and GLM-5 Next), or without a bound
    -rate * softplus(f)."""
    rate = a_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * f)
    return -rate * F.softplus(f)


class ForgetGate(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))

    def forward(self, x):
        """-> log decay g [N, H, K] fp32: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        return head_rate_log_decay(g, self.A_log.view(-1), None)


class KimiDeltaAttention(LinearMixer):
    form = Form.DENSE
    readout = True
    graph_compose = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p = cfg.params
        self.h, self.d = p.linear_num_heads, p.linear_head_dim
        self.qkv_dim = self.h * self.d
        self.conv_width = p.linear_conv_kernel_dim
        hs = cfg.hidden_size
        self.q_proj = nn.Linear(hs, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hs, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hs, self.qkv_dim, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False,
                                padding=self.conv_width - 1)
        self.forget_gate = ForgetGate(hs, self.h, self.d)
        self.b_proj = nn.Linear(hs, self.h, bias=False)
        self.g_a_proj = nn.Linear(hs, self.d, bias=False)
        self.g_b_proj = nn.Linear(self.d, self.qkv_dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.d, cfg.rms_norm_eps, ops)
        self.o_proj = nn.Linear(self.qkv_dim, hs, bias=False)

    @property
    def state_shape(self):
        return self.h, self.d, self.d

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim

    def features(self, x, batch):
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return {"raw": raw, "g": self.forget_gate(x), "beta": torch.sigmoid(self.b_proj(x)),
                "gate": self.g_b_proj(self.g_a_proj(x))}

    def kernel(self, f, conv_out, idx, init, cu, summarize, readout=False, short=None, init_augmented=False,
               max_len=None, factors=False, values=False):
        if factors or values:
            raise ValueError("KDA's runs have no factored summary (factored_runs is False)")
        q, k, v = (t.reshape(-1, self.h, self.d) for t in torch.split(conv_out, self.qkv_dim, dim=-1))
        if init_augmented:
            # the compose pass's short runs, every one from [0 | I] with K zero value columns appended: one fused
            # recurrent call gives each run's outputs from zero, its readout u (the appended columns' outputs) and its
            # [S | T]; no host read (cu may be on the device: the captured pass). The transitions stay dense here
            # (factored_runs is False)
            dv = v.shape[-1]
            va, init0 = augment(v, torch.zeros(cu.shape[0] - 1, self.h, self.d, dv, device=v.device), self.d)
            o, final = self.ops.recurrent_kda(q[None], k[None], va[None], f["g"][None, idx], f["beta"][None, idx],
                                              initial_state=init0, output_final_state=True, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True)
            return o[0, ..., :dv], o[0, ..., dv:], final
        fn = self.ops.recurrent_kda if int((cu[1:] - cu[:-1]).max()) == 1 else self.ops.chunk_kda
        return dense_summary_kernel(fn, q, k, v, init, cu, summarize, readout, g=f["g"][None, idx], beta=f["beta"][None, idx],
                                    use_qk_l2norm_in_kernel=True)

    def capturable(self, device) -> bool:
        """The compose pass can be captured in a CUDA graph: fla's fused recurrent KDA kernel reads cu_seqlens on the
        device; the reference reads it on the host."""
        from ..ops.fast import _fla_kda

        return self.ops.name == "fast" and _fla_kda() is not None

    def output(self, x, o, f):
        n = x.shape[0]
        return self.o_proj(self.o_norm(o, f["gate"].view(n, self.h, self.d)).reshape(n, self.qkv_dim))
