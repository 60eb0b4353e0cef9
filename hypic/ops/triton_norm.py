"""Triton kernel: row norms over a last dimension of at most 512 (CUDA; tests run it in Triton's interpreter).

The per-head norms of a prefill have few columns and many rows: the attention's query and key norms (head dim 256;
rows = tokens x heads), Gated DeltaNet's gated output norm (value head dim 128) and the l2 norm of its queries and
keys (key head dim 128). fla-core 0.6's kernels for these shapes take a bucket of the row count as a compile-time
constant that also keys their autotuning (`NB`: rows / 2,048 for the plain norm, rows / 65,536 for the gated and
l2 norms), so each new bucket compiles and times all nine of their configurations again. For the query norm that
is every 128 tokens of prompt length: a serving engine met a multi-second stall at each new length (H200 runs
38-47: 16-18 s per `prefix`-mode request, the first cold prefill 27 -> 43 s when the fused norms came in). Here
one configuration per width, chosen from the row's size and never retuned; the row count is a runtime argument.

    KIND 0: y = x / rms(x) * w                      (rms(x) = sqrt(mean(x^2) + eps))
    KIND 1: y = x / rms(x) * w * act(g)             (act: silu, or sigmoid)
    KIND 2: y = x / sqrt(sum(x^2) + eps)            (l2 norm, no weight)

fp32 inside, one rounding to y's dtype: the arithmetic of ops/reference/norm.py and of the reference l2 norm.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 512     # wider rows keep fla's kernels, whose tuning key has no row count


@triton.jit
def _norm_rows(x, g, w, y, T, eps, g_group, g_stride, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
               KIND: tl.constexpr, SILU: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    mc = cols < D
    m = (rows < T)[:, None] & mc[None, :]
    off = rows[:, None] * D + cols[None, :]
    xv = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(xv * xv, 1)
    if KIND == 2:
        yv = xv * (1.0 / tl.sqrt(ss + eps))[:, None]
    else:
        yv = xv * (1.0 / tl.sqrt(ss / D + eps))[:, None]
        yv = yv * tl.load(w + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
        if KIND == 1:
            # the gate's rows in groups of g_group contiguous rows, g_stride apart (a view of a joined GEMM's columns)
            g_off = (rows // g_group * g_stride + rows % g_group * D)[:, None] + cols[None, :]
            gv = tl.load(g + g_off, mask=m, other=0.0).to(tl.float32)
            if SILU:
                yv = yv * (gv * tl.sigmoid(gv))
            else:
                yv = yv * tl.sigmoid(gv)
    tl.store(y + off, yv.to(y.dtype.element_ty), mask=m)


def _config(d: int) -> tuple[int, int, int]:
    """(padded width, rows per program, warps): ~4k fp32 values per program of 4 warps (32 per thread)."""
    bd = max(16, triton.next_power_of_2(d))
    return bd, max(1, 4096 // bd), 4


def norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, gate: torch.Tensor | None = None,
              activation: str = "silu", l2: bool = False) -> torch.Tensor:
    """x [..., D] (D <= MAX_WIDTH) -> y in x's dtype and shape: the RMS norm with `weight` [D], times act(gate)
    (gate shaped like x) where given, or with l2=True the l2 norm (no weight)."""
    d = x.shape[-1]
    if d > MAX_WIDTH:
        raise ValueError(f"rows of {d} > {MAX_WIDTH} columns: fla's row kernels take these")
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"unknown activation {activation!r}")
    xr = x.reshape(-1, d).contiguous()
    y = torch.empty_like(xr)
    t = xr.shape[0]
    if t == 0:
        return y.view(x.shape)
    kind = 2 if l2 else 1 if gate is not None else 0
    g, g_group, g_stride = _grouped_rows(gate, d) if gate is not None else (xr, 1, d)
    w = weight.contiguous() if weight is not None else xr
    bd, bt, warps = _config(d)
    _norm_rows[(triton.cdiv(t, bt),)](xr, g, w, y, t, eps, g_group, g_stride, D=d, BD=bd, BT=bt, KIND=kind,
                                      SILU=activation == "silu", num_warps=warps)
    return y.view(x.shape)


def _grouped_rows(t: torch.Tensor, d: int) -> tuple[torch.Tensor, int, int]:
    """t [..., G, d] as (tensor, G, stride): its rows in groups of G contiguous rows of d, `stride` elements apart
    (a linear layer's gate: columns of a joined GEMM's output, [N, H, d] with row stride > H * d), read in place;
    a copy (G = 1, stride d) where t is not so laid out."""
    if t.dim() >= 2 and t.stride(-1) == 1 and t.stride(-2) == d:
        try:
            lead = t.view(-1, t.shape[-2], d)
        except RuntimeError:
            lead = None
        if lead is not None and (lead.shape[0] <= 1 or lead.stride(0) >= t.shape[-2] * d):
            return lead, t.shape[-2], lead.stride(0) if lead.shape[0] > 1 else t.shape[-2] * d
    return t.reshape(-1, d).contiguous(), 1, d


__all__ = ["norm_rows", "MAX_WIDTH"]
