"""RMS norms (fp32 inside).

The normalisation itself is `F.rms_norm` on the fp32 upcast (one fused kernel on CUDA, the same
arithmetic as x * rsqrt(mean(x^2) + eps) written out), so each norm is a few kernels, not eight.
Given an op backend (`ops`) whose `rms_norm` / `rms_norm_gated` are fused kernels (the fast backend on
CUDA: fla-core's), a norm is one kernel: fp32 inside, one rounding at the end. Where a checkpoint's
convention rounds in between (transformers' Qwen3.5 gated norm), the fused form is the more exact one
and the two differ by at most an ulp of the output dtype; the reference backend keeps the convention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import reference


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32."""
    return F.rms_norm(x.float(), x.shape[-1:], None, eps)


def _fused(ops, x: torch.Tensor) -> bool:
    """The backend's fused norm applies: the fast backend on CUDA (elsewhere the module's own arithmetic)."""
    return ops is not None and ops.name == "fast" and x.is_cuda


def _ops(ops, x: torch.Tensor):
    """The backend whose norm ops run x, for norms whose arithmetic is the fused form's: the fast one on CUDA,
    else the reference ops (the same arithmetic, written out)."""
    return ops if _fused(ops, x) else reference


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), the product in fp32 (one rounding)."""

    def __init__(self, dim: int, eps: float, ops=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.ops = ops
        self._scale = (None, None)

    def scale(self) -> torch.Tensor:
        """1 + w in fp32, made once per version of the weight (under autograd: made each call)."""
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return 1.0 + w.float()
        key = (w.data_ptr(), w._version, w.device)
        if self._scale[0] != key:
            self._scale = (key, 1.0 + w.detach().float())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ops(self.ops, x).rms_norm(x, self.scale(), self.eps)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, forward(x + r)): a residual add and this norm of its rounded sum, one kernel on the fast backend."""
        return _ops(self.ops, x).add_rms_norm(x, r, self.scale(), self.eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """forward(x) of x [N, H, D] rotated by RoPE (rotate-half over each head's first rotary_dim dims; cos, sin
        [N, >= rotary_dim / 2]), written into out where given: `Rotary.apply_into`'s result on the normed x, in
        one kernel on the fast backend."""
        return _ops(self.ops, x).rms_norm_rope(x, self.scale(), self.eps, cos, sin, rotary_dim, out)


class RMSNormGated(nn.Module):
    """w * x / rms(x), then * act(gate) (norm before gate; act silu, or sigmoid where Qwen4-Exp's config says so). The
    reference rounds x / rms(x) and its product with w to x's dtype before the gate (transformers' Qwen3.5
    convention)."""

    def __init__(self, dim: int, eps: float, ops=None, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"gated norm activation {activation!r}: silu or sigmoid")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if _fused(self.ops, x):
            return self.ops.rms_norm_gated(x, gate, self.weight, self.eps, self.activation)
        dtype = x.dtype
        y = self.weight * _normed(x, self.eps).to(dtype)
        act = F.silu if self.activation == "silu" else torch.sigmoid
        return (y * act(gate.float())).to(dtype)


class UnweightedRMSNorm(nn.Module):
    """x / rms(x) in fp32, cast back to x's dtype; no parameter (FalconMamba's dt / B / C norms, GLM-5 Next's
    hyper-connection input)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normed(x, self.eps).to(x.dtype)


class ScaledRMSNorm(nn.Module):
    """Plain RMSNorm: w * (x / rms(x)), the normalised x cast back to x's dtype before the scale
    (Llama / Kimi / MiniMax / Nemotron-H convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normed(x, self.eps).to(x.dtype)


class FP32ScaledRMSNorm(ScaledRMSNorm):
    """w * (x / rms(x)) with the weight multiply in fp32 and the product cast (Nemotron-H, OLMo 2/3)."""

    def forward(self, x):
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class SigmoidGatedRMSNorm(nn.Module):
    """w * x / rms(x) * sigmoid(gate), fp32 inside (KDA's output norm): the fused form's arithmetic."""

    def __init__(self, dim: int, eps: float, ops=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _ops(self.ops, x).rms_norm_gated(x, gate, self.weight, self.eps, "sigmoid")
