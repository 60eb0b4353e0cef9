"""Triton kernel: the zero-start summaries of short runs of the gated delta rule (CUDA only).

The compose pass recomputes short runs (seam windows, the query in pieces of <= 16 tokens) from zero
with K value columns appended: the state starts at [0 | I] and ends at [S | T], and the outputs of
the appended columns are the readout u_t (layers/linear.py, `dense_summary_kernel`). fla's fused
recurrent kernel does this with the [0 | I] initial state read from memory for every run (per layer
109 MB at the 35B benchmark's 26 runs x 32 heads x 128 x 256 fp32) and blocks of 8 value columns
(26k programs, each reading every token's q and k): 0.19 ms per layer on the H200 (run 14). Here
the identity is made in registers, and a program holds a block of 64 of the V + K columns:

    program (run, value head, column block): X [K, BV] <- [0 | I] columns; per token
        X <- exp(g) X;  X <- X + k (beta (v - k^T X))^T;  o <- X^T (scale q)
    (q, k l2-normalised in the kernel when asked); o written for all V + K columns in v's dtype, the
    final X as fp32.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token(X, t, q, k, v, g, beta, o, hk, hv, rk, cols, mk, mc, is_v, s_q, s_k, s_v, scale,
           HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L2: tl.constexpr):
    t64 = t.to(tl.int64)
    qt = tl.load(q + t64 * s_q + hk * K + rk, mask=mk, other=0.0).to(tl.float32)
    kt = tl.load(k + t64 * s_k + hk * K + rk, mask=mk, other=0.0).to(tl.float32)
    if L2:
        qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
        kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
    qt = qt * scale
    vt = tl.load(v + t64 * s_v + hv * V + cols, mask=mc & is_v, other=0.0).to(tl.float32)   # [v | 0]
    gt = tl.load(g + t64 * HV + hv).to(tl.float32)
    bt = tl.load(beta + t64 * HV + hv).to(tl.float32)
    X = X * tl.exp(gt)
    pred = tl.sum(kt[:, None] * X, axis=0)
    X = X + kt[:, None] * ((vt - pred) * bt)[None, :]
    ot = tl.sum(qt[:, None] * X, axis=0)
    tl.store(o + (t64 * HV + hv) * (V + K) + cols, ot.to(o.dtype.element_ty), mask=mc)
    return X


@triton.jit
def _summary_kernel(q, k, v, g, beta, cu, o, final, s_q, s_k, s_v, scale, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
                    STAGES: tl.constexpr):
    r = tl.program_id(0)
    hv = tl.program_id(1)
    cb = tl.program_id(2)
    hk = hv // (HV // H)
    rk = tl.arange(0, BK)
    cols = cb * BV + tl.arange(0, BV)
    mk = rk < K
    mc = cols < V + K
    is_v = cols < V
    X = tl.where((cols[None, :] - V) == rk[:, None], 1.0, 0.0)          # [0 | I]
    X = tl.where(mk[:, None] & mc[None, :], X, 0.0)
    t0 = tl.load(cu + r)
    t1 = tl.load(cu + r + 1)
    if STAGES > 1:                          # pipelined (the interpreter cannot range over loaded bounds)
        for t in tl.range(t0, t1, num_stages=STAGES):
            X = _token(X, t, q, k, v, g, beta, o, hk, hv, rk, cols, mk, mc, is_v, s_q, s_k, s_v, scale, HV, K, V, L2)
    else:
        t = t0
        while t < t1:
            X = _token(X, t, q, k, v, g, beta, o, hk, hv, rk, cols, mk, mc, is_v, s_q, s_k, s_v, scale, HV, K, V, L2)
            t += 1
    off = ((r * HV + hv).to(tl.int64) * K + rk[:, None]) * (V + K) + cols[None, :]
    tl.store(final + off, X, mask=mk[:, None] & mc[None, :])


def summary(q, k, v, g, beta, cu_seqlens, *, scale=None, use_qk_l2norm_in_kernel=False, block_v: int = 64,
            warps: int = 4):
    """q, k [1, N, H, K], v [1, N, HV, V] (each with unit strides inside a token), g, beta [1, N, HV],
    cu_seqlens [R + 1] (device int) -> (o [N, HV, V], u [N, HV, K] in v's dtype, final [R, HV, K, V + K] fp32):
    every run from [0 | I] with [v | 0]. No host sync (CUDA-graph safe)."""
    _, n, h, kd = q.shape
    hv, vd = v.shape[-2], v.shape[-1]
    q, k, v = q[0], k[0], v[0]
    for x in (q, k, v):
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            raise ValueError("q, k, v need unit strides inside a token")
    r = cu_seqlens.shape[0] - 1
    scale = kd ** -0.5 if scale is None else scale
    o = v.new_empty((n, hv, vd + kd))
    final = torch.empty(r, hv, kd, vd + kd, dtype=torch.float32, device=v.device)
    _summary_kernel[(r, hv, triton.cdiv(vd + kd, block_v))](
        q, k, v, g[0].contiguous(), beta[0].contiguous(), cu_seqlens, o, final, q.stride(0), k.stride(0), v.stride(0),
        scale, H=h, HV=hv, K=kd, V=vd, BK=max(16, triton.next_power_of_2(kd)), BV=block_v,
        L2=use_qk_l2norm_in_kernel, STAGES=1 if not q.is_cuda else 2, num_warps=warps)
    return o[..., :vd], o[..., vd:], final
