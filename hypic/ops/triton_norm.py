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
    KIND 0 with R > 0: y's first R columns then rotated by RoPE (rotate-half), the query and key norms of a gated
    attention layer and their positions in one launch (the compose pass: was a copy of the strided heads, the norm,
    and five to seven elementwise ops of the rotation)

Rows of x may be strided views ([N, G, D] with any row strides: the heads of a joined GEMM's output, the summary's
[o | u] rows): read in place.

fp32 inside, one rounding to y's dtype: the arithmetic of ops/reference/norm.py and of the reference l2 norm.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 512     # wider rows keep fla's kernels, whose tuning key has no row count


@triton.jit
def _norm_rows(x, g, w, y, cs, sn, T, eps, x_group, xs0, xs1, g_group, gs0, gs1, y_group, ys0, ys1, cs_stride,
               D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, KIND: tl.constexpr, SILU: tl.constexpr,
               R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    mc = cols < D
    m = (rows < T)[:, None] & mc[None, :]
    # row r of x is head r % x_group of token r // x_group (x [N, G, D] with strides xs0, xs1, 1: a view of a joined
    # GEMM's columns, or of the summary's [o | u] rows, read in place); the gate and y likewise with their own strides
    x_row = rows // x_group * xs0 + rows % x_group * xs1
    xv = tl.load(x + x_row[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(xv * xv, 1)
    if KIND == 2:
        yv = xv * (1.0 / tl.sqrt(ss + eps))[:, None]
    else:
        inv = 1.0 / tl.sqrt(ss / D + eps)
        yv = xv * inv[:, None]
        yv = yv * tl.load(w + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
        if KIND == 1:
            g_off = (rows // g_group * gs0 + rows % g_group * gs1)[:, None] + cols[None, :]
            gv = tl.load(g + g_off, mask=m, other=0.0).to(tl.float32)
            if SILU:
                yv = yv * (gv * tl.sigmoid(gv))
            else:
                yv = yv * tl.sigmoid(gv)
        if R > 0:
            # rotate-half RoPE of the first R columns at the token's row of the cos / sin tables (their first halves),
            # in the reference's roundings (ops/reference/attention.py rope_into on the rounded norm): the norm's
            # output rounded to y's dtype, each product rounded, then the sum. Column c's partner c +- R / 2 is
            # loaded again and normed by the row's own scale.
            half: tl.constexpr = R // 2
            rot = cols < R
            pc = tl.where(cols < half, cols + half, cols - half)
            mr = m & rot[None, :]
            xp = tl.load(x + x_row[:, None] + pc[None, :], mask=mr, other=0.0).to(tl.float32)
            yp = xp * inv[:, None] * tl.load(w + pc, mask=rot, other=0.0).to(tl.float32)[None, :]
            yb = yv.to(y.dtype.element_ty).to(tl.float32)
            ypb = yp.to(y.dtype.element_ty).to(tl.float32)
            t_off = (rows // x_group * cs_stride)[:, None] + tl.where(cols < half, cols, cols - half)[None, :]
            c = tl.load(cs + t_off, mask=mr, other=0.0).to(tl.float32)
            sv = tl.load(sn + t_off, mask=mr, other=0.0).to(tl.float32)
            a = (yb * c).to(y.dtype.element_ty).to(tl.float32)
            b = (ypb * sv).to(y.dtype.element_ty).to(tl.float32)
            yv = tl.where(rot[None, :], tl.where((cols < half)[None, :], a - b, a + b), yv)
    y_row = rows // y_group * ys0 + rows % y_group * ys1
    tl.store(y + y_row[:, None] + cols[None, :], yv.to(y.dtype.element_ty), mask=m)


@triton.jit
def _add_norm_rows(x, r, w, s, y, T, eps, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    """Rows of a residual sum and its RMS norm: s = x + r rounded to s's dtype (the model's residual add), y =
    s / rms(s) * w from that rounded s, fp32 inside, one rounding (`add_norm_rows`). Contiguous [T, D] rows."""
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    mc = cols < D
    m = (rows < T)[:, None] & mc[None, :]
    off = rows[:, None] * D + cols[None, :]
    sv = tl.load(x + off, mask=m, other=0.0).to(tl.float32) + tl.load(r + off, mask=m, other=0.0).to(tl.float32)
    sr = sv.to(s.dtype.element_ty)
    tl.store(s + off, sr, mask=m)
    sv = sr.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sv * sv, 1) / D + eps)
    yv = sv * inv[:, None] * tl.load(w + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    tl.store(y + off, yv.to(y.dtype.element_ty), mask=m)


def add_norm_rows(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + r in x's dtype (one rounding), y = the RMS norm of s with `weight` [D] (fp32 inside, one
    rounding): ops/reference/norm.py add_rms_norm in one launch (two before: the residual add, then the norm, which
    read s back). x and r of one shape and dtype, D <= ADD_MAX_WIDTH; rows copied to contiguous where they are not."""
    d = x.shape[-1]
    if r.shape != x.shape or r.dtype != x.dtype or weight.shape != (d,) or d > ADD_MAX_WIDTH:
        raise ValueError(f"add_norm_rows: x {tuple(x.shape)} {x.dtype}, r {tuple(r.shape)} {r.dtype}, weight "
                         f"{tuple(weight.shape)} (at most {ADD_MAX_WIDTH} columns)")
    xr, rr = x.reshape(-1, d).contiguous(), r.reshape(-1, d).contiguous()
    s, y = torch.empty_like(xr), torch.empty_like(xr)
    t = xr.shape[0]
    if t:
        bd, bt, warps = _config(d)
        _add_norm_rows[(triton.cdiv(t, bt),)](xr, rr, weight.contiguous(), s, y, t, eps, D=d, BD=bd, BT=bt,
                                              num_warps=warps)
    return s.view(x.shape), y.view(x.shape)


ADD_MAX_WIDTH = 8192     # (a row's fp32 values in one program: 64 a thread at 4 warps)


def _config(d: int) -> tuple[int, int, int]:
    """(padded width, rows per program, warps): ~4k fp32 values per program of 4 warps (32 per thread)."""
    bd = max(16, triton.next_power_of_2(d))
    return bd, max(1, 4096 // bd), 4


def norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, gate: torch.Tensor | None = None,
              activation: str = "silu", l2: bool = False, rope: tuple | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] (D <= MAX_WIDTH) -> y in x's dtype and shape: the RMS norm with `weight` [D], times act(gate)
    (gate shaped like x) where given, or with l2=True the l2 norm (no weight). x [N, G, D] whose rows are strided
    (a view of wider rows) is read in place. rope (cos, sin, rotary_dim), with the plain norm of x [N, G, D]: the
    normed rows rotated (rotate-half over each head's first rotary_dim columns, cos / sin [N, >= rotary_dim / 2]
    at each token's row; ops/reference/attention.py rope_into's roundings). out: y written there ([N, G, D]-shaped,
    unit column stride) and returned; else a new contiguous tensor."""
    d = x.shape[-1]
    if d > MAX_WIDTH:
        raise ValueError(f"rows of {d} > {MAX_WIDTH} columns: fla's row kernels take these")
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"unknown activation {activation!r}")
    if rope is not None and (gate is not None or l2 or x.dim() != 3 or rope[2] % 2 or not 0 <= rope[2] <= d):
        raise ValueError("rope is for the plain norm of x [N, G, D], over an even rotary_dim <= D")
    xr, x_group, xs0, xs1 = _row_layout(x, d)
    t = xr.shape[0] * x_group
    if out is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        if out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError("out must be shaped as x, of its dtype, with unit column stride")
        y = out
    yv, y_group, ys0, ys1 = _row_layout(y, d)
    if y.numel() and yv.data_ptr() != y.data_ptr():          # (a copy: the rows written would be lost)
        raise ValueError("out's rows cannot be addressed in place")
    if t == 0:
        return y
    kind = 2 if l2 else 1 if gate is not None else 0
    g, g_group, gs0, gs1 = _row_layout(gate, d) if gate is not None else (xr, 1, d, d)
    w = weight.contiguous() if weight is not None else xr
    cs, sn, r = (rope[0], rope[1], rope[2]) if rope is not None else (xr, xr, 0)
    if r and (cs.stride(-1) != 1 or sn.stride() != cs.stride() or cs.shape[0] != x.shape[0]):
        raise ValueError("cos and sin must be [N, >= rotary_dim / 2] with one row per token, unit column stride")
    bd, bt, warps = _config(d)
    _norm_rows[(triton.cdiv(t, bt),)](xr, g, w, yv, cs, sn, t, eps, x_group, xs0, xs1, g_group, gs0, gs1, y_group,
                                      ys0, ys1, cs.stride(0) if r else 0, D=d, BD=bd, BT=bt, KIND=kind,
                                      SILU=activation == "silu", R=r, num_warps=warps)
    return y


def _row_layout(t: torch.Tensor, d: int) -> tuple[torch.Tensor, int, int, int]:
    """t [..., d] as (tensor, G, s0, s1): row r of its rows [M * G, d] at (r // G) * s0 + (r % G) * s1, read or
    written in place where t is [M, G, d] with unit column stride (any row strides: e.g. a linear layer's gate, the
    columns of a joined GEMM's output), or can be viewed as rows of d (G = 1); else a contiguous copy (G = 1)."""
    if t.stride(-1) == 1:
        if t.dim() == 3:
            return t, t.shape[1], t.stride(0), t.stride(1)
        try:
            v = t.view(-1, d)
        except RuntimeError:
            v = None
        if v is not None:
            return v, 1, v.stride(0) if v.shape[0] > 1 else d, d
    c = t.reshape(-1, d).contiguous()
    return c, 1, d, d


__all__ = ["norm_rows", "add_norm_rows", "MAX_WIDTH", "ADD_MAX_WIDTH"]
