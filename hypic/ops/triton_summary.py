"""Triton kernels: the zero-start summaries of short runs of the gated delta rule (CUDA only).

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

That kernel's 16 dependent steps, each with two cross-warp reductions, set its time (0.23 ms per layer in
H200 run 15). `chunk_summary`, what the compose pass takes (runs of at most 64 tokens), computes the
same in the chunked (WY) form, one chunk per run: a few small tensor-core products per program and no
loop over the tokens (0.12 ms per layer, run 16).

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference.gated_delta import CHUNK_MAX, factor_width


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


def _outputs(q, k, v, cu_seqlens, scale, dense: bool = True):
    """The kernels' token-major views of q, k, v (checked), their outputs' buffers (the final [S | T] when dense,
    else S), the sizes, the scale."""
    _, n, h, kd = q.shape
    hv, vd = v.shape[-2], v.shape[-1]
    q, k, v = q[0], k[0], v[0]
    for x in (q, k, v):
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            raise ValueError("q, k, v need unit strides inside a token")
    r = cu_seqlens.shape[0] - 1
    o = v.new_empty((n, hv, vd + kd))
    final = torch.empty(r, hv, kd, vd + kd if dense else vd, dtype=torch.float32, device=v.device)
    return q, k, v, o, final, (r, h, hv, kd, vd), kd ** -0.5 if scale is None else scale


def summary(q, k, v, g, beta, cu_seqlens, *, scale=None, use_qk_l2norm_in_kernel=False, block_v: int = 64,
            warps: int = 4):
    """q, k [1, N, H, K], v [1, N, HV, V] (each with unit strides inside a token), g, beta [1, N, HV],
    cu_seqlens [R + 1] (device int) -> (o [N, HV, V], u [N, HV, K] in v's dtype, final [R, HV, K, V + K] fp32):
    every run from [0 | I] with [v | 0]. No host sync (CUDA-graph safe)."""
    q, k, v, o, final, (r, h, hv, kd, vd), scale = _outputs(q, k, v, cu_seqlens, scale)
    _summary_kernel[(r, hv, triton.cdiv(vd + kd, block_v))](
        q, k, v, g[0].contiguous(), beta[0].contiguous(), cu_seqlens, o, final, q.stride(0), k.stride(0), v.stride(0),
        scale, H=h, HV=hv, K=kd, V=vd, BK=max(16, triton.next_power_of_2(kd)), BV=block_v,
        L2=use_qk_l2norm_in_kernel, STAGES=1 if not q.is_cuda else 2, num_warps=warps)
    return o[..., :vd], o[..., vd:], final


@triton.jit
def _summary_columns(cb, r, hv, hk, q, k, v, o, final, fac, uval, tok, rl, rk, mt, mk, nq, nk, G, GL, bt, Ti, P,
                     kdec, s_q, s_k, s_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     BL: tl.constexpr, PREC: tl.constexpr, FACTORS: tl.constexpr, VALUES: tl.constexpr):
    """Column block cb of [v | 0] and of the identity: right-hand sides beta v (-> U) and beta exp(G) k (-> W)
    (the K columns are those of k, l2-normalised like Kx); their outputs, and S / T (or T's factors; with VALUES,
    U instead of S: S = Kd^T U)."""
    cols = cb * BV + tl.arange(0, BV)
    is_v = cols < V
    kc = cols - V
    is_k = (kc >= 0) & (kc < K)
    mv = mt[:, None] & is_v[None, :]
    mkc = mt[:, None] & is_k[None, :]
    Vb = tl.load(v + tok[:, None] * s_v + hv * V + cols[None, :], mask=mv, other=0.0).to(tl.float32)
    Kb = tl.load(k + tok[:, None] * s_k + hk * K + kc[None, :], mask=mkc, other=0.0).to(tl.float32) * nk[:, None]
    Qb = tl.load(q + tok[:, None] * s_q + hk * K + kc[None, :], mask=mkc, other=0.0).to(tl.float32) * nq[:, None]
    eG = tl.exp(G)
    rhs = tl.where(is_v[None, :], Vb, Kb * eG[:, None]) * bt[:, None]
    sol = tl.dot(Ti, rhs, input_precision=PREC)                 # U (value columns) or W (identity columns)
    fin = tl.dot(tl.trans(kdec), sol, input_precision=PREC)    # [K, BV]
    out = tl.dot(P, sol, input_precision=PREC)
    out = tl.where(is_v[None, :], out, Qb * eG[:, None] - out)
    mc = is_v | is_k
    tl.store(o + (tok[:, None] * HV + hv) * (V + K) + cols[None, :], out.to(o.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])
    if FACTORS:
        # S (the value columns) [R, HV, K, V]; the transition as factors [R, HV, 2 BL + 1, K]: this block's K
        # columns of Kd = exp(G_L - G) k and of W (rows past the run: zero), and gamma = exp(G_L) in row 2 BL
        if VALUES:      # U [R, HV, BL, V] (rows past the run: zero, as its right-hand side's)
            ub = uval + (r * HV + hv).to(tl.int64) * (BL * V)
            tl.store(ub + rl[:, None] * V + cols[None, :], sol, mask=is_v[None, :])
        else:
            off = ((r * HV + hv).to(tl.int64) * K + rk[:, None]) * V + cols[None, :]
            tl.store(final + off, fin, mask=mk[:, None] & is_v[None, :])
        fb = fac + (r * HV + hv).to(tl.int64) * ((2 * BL + 1) * K)
        tl.store(fb + rl[:, None] * K + kc[None, :], Kb * tl.exp(GL - G)[:, None], mask=is_k[None, :])
        tl.store(fb + (BL + rl)[:, None] * K + kc[None, :], sol, mask=is_k[None, :])
        tl.store(fb + 2 * BL * K + kc, tl.where(kc == 0, tl.exp(GL), 0.0), mask=is_k)
    else:
        ident = tl.where(rk[:, None] == kc[None, :], tl.exp(GL), 0.0)
        fin = tl.where(is_v[None, :], fin, ident - fin)
        off = ((r * HV + hv).to(tl.int64) * K + rk[:, None]) * (V + K) + cols[None, :]
        tl.store(final + off, fin, mask=mk[:, None] & mc[None, :])


@triton.jit
def _chunk_summary_kernel(q, k, v, g, beta, cu, o, final, fac, uval, s_q, s_k, s_v, scale, H: tl.constexpr,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          BL: tl.constexpr, SQUARINGS: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
                          FACTORS: tl.constexpr, NB: tl.constexpr, VALUES: tl.constexpr = False):
    r = tl.program_id(0)
    hv = tl.program_id(1)
    cb0 = tl.program_id(2) * NB           # this program's NB column blocks (the run's shared part made once)
    hk = hv // (HV // H)
    t0 = tl.load(cu + r)
    t1 = tl.load(cu + r + 1)
    rl = tl.arange(0, BL)
    rk = tl.arange(0, BK)
    tok = (t0 + rl).to(tl.int64)
    mt = (t0 + rl) < t1
    mk = rk < K
    m2 = mt[:, None] & mk[None, :]
    Q = tl.load(q + tok[:, None] * s_q + hk * K + rk[None, :], mask=m2, other=0.0).to(tl.float32)
    Kx = tl.load(k + tok[:, None] * s_k + hk * K + rk[None, :], mask=m2, other=0.0).to(tl.float32)
    nq = tl.full((BL,), 1.0, tl.float32)
    nk = tl.full((BL,), 1.0, tl.float32)
    if L2:
        nq = tl.rsqrt(tl.sum(Q * Q, axis=1) + 1e-6)
        nk = tl.rsqrt(tl.sum(Kx * Kx, axis=1) + 1e-6)
    nq = nq * scale
    Q = Q * nq[:, None]
    Kx = Kx * nk[:, None]
    gt = tl.load(g + tok * HV + hv, mask=mt, other=0.0).to(tl.float32)
    bt = tl.load(beta + tok * HV + hv, mask=mt, other=0.0).to(tl.float32)
    G = tl.cumsum(gt, axis=0)                                  # log decay from the run's start, per token
    GL = tl.sum(gt, axis=0)
    lower = rl[:, None] >= rl[None, :]
    D = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))          # exp(G_t - G_s), s <= t
    eye = tl.where(rl[:, None] == rl[None, :], 1.0, 0.0)
    KK = tl.dot(Kx, tl.trans(Kx), input_precision=PREC)
    P = tl.dot(Q, tl.trans(Kx), input_precision=PREC) * D                     # (q_t . k_s) exp(G_t - G_s)
    # (I + A)^-1 with A strictly lower (nilpotent): (I + M)(I + M^2)(I + M^4)... with M = -A
    M = -tl.where(rl[:, None] > rl[None, :], bt[:, None] * KK * D, 0.0)
    Ti = eye + M
    for _ in tl.static_range(SQUARINGS):
        M = tl.dot(M, M, input_precision=PREC)
        Ti = tl.dot(Ti, eye + M, input_precision=PREC)
    kdec = Kx * tl.exp(GL - G)[:, None]
    for i in tl.static_range(NB):
        _summary_columns(cb0 + i, r, hv, hk, q, k, v, o, final, fac, uval, tok, rl, rk, mt, mk, nq, nk, G, GL, bt,
                         Ti, P, kdec, s_q, s_k, s_v, HV, K, V, BV, BL, PREC, FACTORS, VALUES)


def chunk_summary(q, k, v, g, beta, cu_seqlens, max_len: int, *, scale=None, use_qk_l2norm_in_kernel=False,
                  block_v: int = 64, warps: int = 4, precision: str = "tf32x3", factors: bool = False,
                  blocks_per_program: int | None = None, values: bool = False):
    """`summary` for runs of at most max_len (<= CHUNK_MAX) tokens in the chunked (WY) form, one chunk
    per run: with G_t the run's cumulative log decay, A[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t),

        U = (I + A)^-1 beta V,    W = (I + A)^-1 beta exp(G) K
        S = sum_t exp(G_L - G_t) k_t U_t^T,    T = exp(G_L) I - sum_t exp(G_L - G_t) k_t W_t^T
        o_t = sum_{s<=t} exp(G_t - G_s) (q_t.k_s) U_s,    u_t = exp(G_t) q_t - sum_{s<=t} (same) W_s

    (ops/reference/gated_delta.py `chunk_gated_delta_rule` with S_0 = [0 | I]). A program takes one
    (run, value head): the run's shared part ((I + A)^-1, the q.k products) once, then its blocks of the
    V + K columns one after another (blocks_per_program: fewer blocks per program, more programs, each
    making the shared part again; None: one block a program where the (run, head) pairs are fewer than the SMs);
    the products are small tensor-core matmuls, with no step-by-step loop
    over the run's tokens. Same returns as `summary`; with `factors`, T is left in
    its factored form (reference `run_factors`): (o, u, S [R, HV, K, V], F [R, HV, 2 w + 1, K]), w the
    padded run length (`factor_width`); with `values` too, U [R, HV, w, V] in S's place (reference `run_values`;
    S = Kd^T U, not written: the low-rank pairs of `ops/triton_scan.pair_lowrank` read U)."""
    if max_len > CHUNK_MAX:
        raise ValueError(f"runs of up to {max_len} tokens; the chunked summary takes <= {CHUNK_MAX}")
    if values and not factors:
        raise ValueError("values (U) come with the factors")
    q, k, v, o, final, (r, h, hv, kd, vd), scale = _outputs(q, k, v, cu_seqlens, scale, dense=not factors)
    bl = factor_width(max_len)              # rows of the one chunk per run (and of T's factors)
    fac = uval = final
    if factors:
        fac = torch.empty(r, hv, 2 * bl + 1, kd, dtype=torch.float32, device=v.device)
    if values:
        final = uval = torch.empty(r, hv, bl, vd, dtype=torch.float32, device=v.device)
    blocks = triton.cdiv(vd + kd, block_v)
    if blocks_per_program is None:
        # every block of a (run, head) in one program where those programs fill the GPU; fewer runs (a small request;
        # the thirty-first session's query tail, one 64-token run by a call of its own: 32 programs each walking 4
        # blocks, H200 run 107) take a program per block, each making the run's shared part again
        from .triton_scan import _sm_count

        nb = blocks if r * hv >= _sm_count(v.device) else 1
    else:
        nb = max(1, min(blocks_per_program, blocks))
    _chunk_summary_kernel[(r, hv, triton.cdiv(blocks, nb))](
        q, k, v, g[0].contiguous(), beta[0].contiguous(), cu_seqlens, o, final, fac, uval, q.stride(0), k.stride(0),
        v.stride(0), scale, H=h, HV=hv, K=kd, V=vd, BK=max(16, triton.next_power_of_2(kd)), BV=block_v, BL=bl,
        SQUARINGS=bl.bit_length() - 2, L2=use_qk_l2norm_in_kernel, PREC=precision, FACTORS=factors, NB=nb,
        VALUES=values, num_warps=warps)
    if factors:
        return o[..., :vd], o[..., vd:], final, fac
    return o[..., :vd], o[..., vd:], final
