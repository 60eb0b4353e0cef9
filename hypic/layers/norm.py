"""RMS norms of the Qwen3.5 / Qwen3-Next family (fp32 inside).

The normalisation itself is `F.rms_norm` on the fp32 upcast (one fused kernel on CUDA, the same
arithmetic as x * rsqrt(mean(x^2) + eps) written out), so each norm is a few kernels, not eight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32."""
    return F.rms_norm(x.float(), x.shape[-1:], None, eps)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)


class RMSNormGated(nn.Module):
    """w * x / rms(x), then * silu(gate) (norm before gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.weight * _normed(x, self.eps).to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class ScaledRMSNorm(nn.Module):
    """Plain RMSNorm: w * (x / rms(x)), the normalised x cast back to x's dtype before the scale
    (Llama / Kimi / MiniMax / Nemotron-H convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normed(x, self.eps).to(x.dtype)


class SigmoidGatedRMSNorm(nn.Module):
    """w * x / rms(x) * sigmoid(gate), fp32 inside (KDA's output norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps)
        return (y * torch.sigmoid(gate.float())).to(x.dtype)
