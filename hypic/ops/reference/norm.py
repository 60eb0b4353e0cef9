"""Norms and gates in their fused form's arithmetic: fp32 inside, one rounding to the input's dtype at
the end. (A model whose checkpoint convention rounds in between, as transformers' Qwen3.5 gated norm
does, keeps that convention in its own module on the reference backend: layers/norm.py.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str) -> torch.Tensor:
    """x / rms(x) * weight * act(gate), act "silu" (gate * sigmoid(gate)) or "sigmoid"."""
    g = gate.float()
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps) * g).to(x.dtype)


def gdn_gate(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's log decay per token and value head, fp32: -exp(A_log) * softplus(a + dt_bias)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
