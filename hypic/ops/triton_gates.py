"""Triton kernels: the small gates between the projections, one launch where PyTorch made two or three (CUDA; tests
run them in Triton's interpreter).

A warm `pic` request of the 35B model runs ~500 elementwise ops of 2-4 us each between its kernels (H100 run 121's
eager profile, names and sources by gpu_bench's `op_sources`). Two of them per layer are these:

    gate_beta   Gated DeltaNet's log decay and write strength from the joined input GEMM's a and b columns, read in
                place: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's dtype). Was a copy of
                a, fla's gate kernel and a sigmoid: three launches per linear layer.
    act_mul     act(gate) * up with gate and up read in place: SwiGLU's silu(gate) * up from the joined GEMM's
                columns (was silu, then the product: two launches per MoE layer, the shared expert), a gated
                attention's output times sigmoid of its gate heads (was a copy of the strided heads, sigmoid, the
                product: three per attention layer).

The arithmetic is the reference's, rounding for rounding: act_mul rounds act(gate) to the output's dtype before
the product as PyTorch's two ops do, so the fused and unfused forms agree bit for bit (tests/test_gpu.py, in the
interpreter); gate_beta is fp32 throughout as the reference is (softplus with PyTorch's threshold of 20, log1p within ulps).

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_beta_kernel(a, b, a_log, dt_bias, g, beta, N, sa, sb, H: tl.constexpr, BH: tl.constexpr,
                      BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BH)
    mc = cols < H
    m = (rows < N)[:, None] & mc[None, :]
    x = tl.load(a + rows[:, None] * sa + cols[None, :], mask=m, other=0.0).to(tl.float32)
    x += tl.load(dt_bias + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    # softplus as PyTorch's (x past 20: x; else log1p(exp(x))), log1p by Kahan's form log(u) * e / (u - 1) with
    # u = 1 + e, exact to a few ulps where e is tiny (log(1 + e) there would be 0; libdevice's log1p has no
    # interpreter form)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    sp = tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))))
    decay = -tl.exp(tl.load(a_log + cols, mask=mc, other=0.0).to(tl.float32))
    tl.store(g + rows[:, None] * H + cols[None, :], decay[None, :] * sp, mask=m)
    y = tl.load(b + rows[:, None] * sb + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(beta + rows[:, None] * H + cols[None, :], tl.sigmoid(y).to(beta.dtype.element_ty), mask=m)


def gate_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [N, H] (rows may be strided: columns of a joined GEMM's output), a_log, dt_bias [H] -> (g [N, H] fp32,
    beta [N, H] in b's dtype)."""
    n, h = a.shape
    if b.shape != a.shape or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("a and b must be [N, H] with unit column stride")
    g = torch.empty((n, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((n, h), dtype=b.dtype, device=b.device)
    if n:
        bh = max(16, triton.next_power_of_2(h))
        bn = max(1, 2048 // bh)
        _gate_beta_kernel[(triton.cdiv(n, bn),)](a, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, n,
                                                 a.stride(0), b.stride(0), H=h, BH=bh, BN=bn, num_warps=4)
    return g, beta


@triton.jit
def _act_mul_kernel(gate, up, out, N, HD, g0, g1, u0, u1, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    SILU: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = (rows < N)[:, None] & (cols < HD)[None, :]
    head, col = cols // D, cols % D          # column c of a row: head c // D's column c % D (x [N, H, D], strided rows)
    x = tl.load(gate + rows[:, None] * g0 + (head * g1 + col)[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        a = x * tl.sigmoid(x)
    else:
        a = tl.sigmoid(x)
    a = a.to(out.dtype.element_ty).to(tl.float32)                 # the activation's own rounding, as PyTorch's op
    y = tl.load(up + rows[:, None] * u0 + (head * u1 + col)[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out + rows[:, None] * HD + cols[None, :], (a * y).to(out.dtype.element_ty), mask=m)


def _heads(t: torch.Tensor) -> tuple[int, int, int]:
    """t [N, D] or [N, H, D] with unit column stride as (row stride, head stride, D)."""
    if t.stride(-1) != 1 or t.dim() not in (2, 3):
        raise ValueError("gate and up must be [N, D] or [N, H, D] with unit column stride")
    return (t.stride(0), t.shape[-1], t.shape[-1]) if t.dim() == 2 else (t.stride(0), t.stride(1), t.shape[-1])


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate, up [N, D] or [N, H, D] (rows and heads may be strided) -> act(gate) * up as [N, H * D] contiguous, in
    gate's dtype; activation "silu" or "sigmoid"."""
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError("gate and up must have one shape and dtype")
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"unknown activation {activation!r}")
    (g0, g1, d), (u0, u1, _) = _heads(gate), _heads(up)
    n, hd = gate.shape[0], math.prod(gate.shape[1:])
    out = torch.empty((n, hd), dtype=gate.dtype, device=gate.device)
    if n and hd:
        bd = min(1024, max(16, triton.next_power_of_2(hd)))
        bn = max(1, 2048 // bd)
        _act_mul_kernel[(triton.cdiv(n, bn), triton.cdiv(hd, bd))](gate, up, out, n, hd, g0, g1, u0, u1, D=d, BN=bn,
                                                                   BD=bd, SILU=activation == "silu", num_warps=4)
    return out


__all__ = ["gate_beta", "act_mul"]
