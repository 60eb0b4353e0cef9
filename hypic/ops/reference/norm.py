"""Norms and gates in their fused form's arithmetic: fp32 inside, one rounding to the input's dtype at
the end. (A model whose checkpoint convention rounds in between, as transformers' Qwen3.5 gated norm
does, keeps that convention in its own module on the reference backend: layers/norm.py.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual sum and its norm: (s, y), s = x + r in x's dtype (one rounding, as a model's residual add), y =
    rms_norm(s, weight, eps) of that rounded s."""
    s = x + r
    return s, rms_norm(s, weight, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str) -> torch.Tensor:
    """x / rms(x) * weight * act(gate), act "silu" (gate * sigmoid(gate)) or "sigmoid"."""
    g = gate.float()
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps) * g).to(x.dtype)


def gdn_gate(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's log decay per token and value head, fp32: -exp(A_log) * softplus(a + dt_bias)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def gdn_gate_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's log decay (gdn_gate, fp32) and write strength sigmoid(b) (b's dtype) of one layer's tokens."""
    return gdn_gate(a, a_log, dt_bias), torch.sigmoid(b)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up as [N, H * D] (gate and up [N, D] or [N, H, D]), act "silu" (SwiGLU) or "sigmoid" (a gated
    attention's output gate): PyTorch's two ops, each rounding to the inputs' dtype."""
    act = F.silu(gate) if activation == "silu" else torch.sigmoid(gate)
    return (act * up).reshape(gate.shape[0], math.prod(gate.shape[1:]))


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  rotary_dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm of x [N, H, D], then rotate-half RoPE over each head's first rotary_dim dims (cos, sin [N, >=
    rotary_dim / 2], their first halves read; ops/reference/attention.py rope_into's roundings), written into out
    (shaped as x) where given, else a new tensor; returns it."""
    return rotated(rms_norm(x, weight, eps), cos, sin, rotary_dim, out)


def rotated(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm_rope's rotation of the normed heads y (rope_into), into out or a new contiguous tensor; returns it."""
    from .attention import rope_into

    if out is None:
        out = torch.empty_like(y, memory_format=torch.contiguous_format)
    rope_into(y, cos, sin, out, rotary_dim)
    return out
