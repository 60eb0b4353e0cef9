"""Triton kernel: the chains of dense affine maps of many requests in one launch (CUDA only).

Program (request r, value head h, value block b) holds its state block X [K, BV] (fp32) and walks
the request's maps j = cu[r] .. cu[r+1]-1: it writes X to before[j], then X <- T_j X + S_j, with
fp32-accurate products (plain tf32 would cost ~3e-4 relative per map, and chains compound it). The state
never leaves registers between maps; T_j is read once per value block. Products in "tf32x3" (three
tf32 tensor-core products, fp32-level accuracy: 1.6e-6 relative after 20 maps of K = 128 on the H200,
against 5.8e-7 for IEEE FMA, which ran 70x slower: benchmarks/results/gpu_check.json).

Where a map's (T, S) come from, per slot m (storage order; `order` gives the chain's sequence):
    m <  E   a cached segment: T [E, H, K, K] and S [E, H, K, V] stacked
    m >= E   a run's [S | T] [N, H, K, V + K], as the appended-identity kernel wrote it
Both loads are issued masked (one of them fetches nothing), so the loop body has no branch and
Triton can pipeline the next map's loads behind this map's products (`stages`).
`scan_steps` is the compose pass's form: a table names each step's T and S by address (a cached
segment's own tensors where the cache keeps them; a run's at its offset in the runs' buffer), so no
map is copied and the loop reads no slot order (H200 run 13: the address-table-through-`order` form
cost 0.28 ms per layer against 0.17 ms for stacked maps). A step issues all its loads before its
products, and reads a dense map with constant strides under a uniform branch on its kind. A short run's
transition may come factored (layers/linear.py RUN_FACTORS, off by default since run 33),
T = gamma I - Kd^T W with Kd, W of w <= 64 rows (ops/reference/gated_delta.py `run_factors`): its step
is then x <- gamma x - Kd^T (W x) + S, two [w x K] products instead of a dense [K x K] one, reading
2 w K floats instead of K^2 (the warm pic request: 24 of its 44 steps per layer are such runs).

The block width, warps and pipeline depth are picked per shape by timing a few configurations on
the first eager call (not while a CUDA graph is being captured: then the default is used).

Imported lazily (compose/scan.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
from .triton_address import from_address
from .tuning import tuned_config

_FROM_ZERO = tl.constexpr(STEP_FROM_ZERO)          # (a module global a kernel reads must be a constexpr)
_BY_POSITION = tl.constexpr(STEP_BY_POSITION)


@triton.jit
def _step(x, j, init, T, S, A, before, order, E, h, off_kv, off_kk, off_a_s, off_a_t, m_kv, m_kk,
          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, ORDER: tl.constexpr,
          RUNS: tl.constexpr, RUNS_ONLY: tl.constexpr):
    """Map j of the chain: before[m] <- x, then x <- T_m x + S_m."""
    if ORDER:
        m = tl.load(order + j)
    else:
        m = j
    if RUNS:
        is_run = m >= E
    else:
        is_run = m < 0
    ent = m < E
    if RUNS_ONLY:
        tl.store(before + (m * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv & is_run)
    else:
        tl.store(before + (m * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv)
    me = tl.maximum(tl.minimum(m, E - 1), 0)
    t = tl.load(T + (me * H + h).to(tl.int64) * K * K + off_kk, mask=m_kk & ent, other=0.0)
    s = tl.load(S + (me * H + h).to(tl.int64) * K * V + off_kv, mask=m_kv & ent, other=0.0)
    if RUNS:
        base_a = (tl.maximum(m - E, 0) * H + h).to(tl.int64) * K * (V + K)
        t += tl.load(A + base_a + off_a_t, mask=m_kk & is_run, other=0.0)
        s += tl.load(A + base_a + off_a_s, mask=m_kv & is_run, other=0.0)
    return tl.dot(t, x, input_precision=PREC) + s


@triton.jit
def _state_block(K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (request r, value head h, value block): r, h, the state block's rows rk and columns rv, its mask and
    its offsets in a [K, V] state."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    return r, h, rk, rv, (rk < K)[:, None] & (rv < V)[None, :], rk[:, None] * V + rv[None, :]


@triton.jit
def _scan_kernel(init, T, S, A, before, final, cu, order, E, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ORDER: tl.constexpr,
                 RUNS: tl.constexpr, RUNS_ONLY: tl.constexpr, STAGES: tl.constexpr):
    r, h, rk, rv, m_kv, off_kv = _state_block(K, V, BK, BV)
    m_kk = (rk < K)[:, None] & (rk < K)[None, :]
    off_kk = rk[:, None] * K + rk[None, :]
    off_a_s = rk[:, None] * (V + K) + rv[None, :]          # A [N, H, K, V + K] = [S | T] of the runs
    off_a_t = rk[:, None] * (V + K) + V + rk[None, :]
    x = tl.load(init + (r * H + h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    j0 = tl.load(cu + r)
    j1 = tl.load(cu + r + 1)
    if STAGES > 1:                  # a pipelined loop (Triton's interpreter cannot range over loaded bounds)
        for j in tl.range(j0, j1, num_stages=STAGES):
            x = _step(x, j, init, T, S, A, before, order, E, h, off_kv, off_kk, off_a_s, off_a_t, m_kv, m_kk,
                      H, K, V, PREC, ORDER, RUNS, RUNS_ONLY)
    else:
        j = j0
        while j < j1:
            x = _step(x, j, init, T, S, A, before, order, E, h, off_kv, off_kk, off_a_s, off_a_t, m_kv, m_kk,
                      H, K, V, PREC, ORDER, RUNS, RUNS_ONLY)
            j += 1
    tl.store(final + (r * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv)


@triton.jit
def _is_run(row):
    """A step table row's kind (column 2, bit 0): a run's map, else a cached segment's (compose/scan.py STEP_FROM_ZERO
    may be set beside it)."""
    return (tl.load(row + 2) & 1) != 0


@triton.jit
def _dense_s(sv, is_run, a_addr, h, off_kv, off_as, m_kv, K: tl.constexpr, V: tl.constexpr, EVEN: tl.constexpr):
    """A dense step's S block [K, BV]: a cached map's own S [H, K, V] (address sv), or a run's S columns of its
    [S | T] rows [H, K, V + K] at byte offset sv from a_addr (one return: the compiler refused a helper with a return
    in each branch, H100 run 111)."""
    if is_run:
        s = _load_block((sv + a_addr).to(tl.pointer_type(tl.float32)) + h * (K * (V + K)) + off_as, m_kv, EVEN)
    else:
        s = _load_block(sv.to(tl.pointer_type(tl.float32)) + h * (K * V) + off_kv, m_kv, EVEN)
    return s


@triton.jit
def _dense_map(tv, sv, is_run, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv, m_kk, K: tl.constexpr,
               V: tl.constexpr, EVEN: tl.constexpr):
    """A step's dense T [K, K] and S block [K, BV]: a cached map's own (T [H, K, K], S [H, K, V] at addresses
    tv, sv), or a run's [S | T] rows [H, K, V + K] at byte offsets tv, sv from a_addr. A uniform branch on the
    map's kind, each side reading with constant strides from offsets made once per program (off_kk, off_kv;
    off_at, off_as), so a load costs one add per element (H200 runs 35-36: 0.7 ms faster on the warm request
    than strides chosen per element at run time; run 34's profile had the integer pipe the busiest). EVEN: the
    blocks cover K and V exactly (no masks)."""
    if is_run:
        t = _load_block((tv + a_addr).to(tl.pointer_type(tl.float32)) + h * (K * (V + K)) + off_at, m_kk, EVEN)
    else:
        t = _load_block(tv.to(tl.pointer_type(tl.float32)) + h * (K * K) + off_kk, m_kk, EVEN)
    return t, _dense_s(sv, is_run, a_addr, h, off_kv, off_as, m_kv, K, V, EVEN)


@triton.jit
def _load_block(ptrs, mask, EVEN: tl.constexpr):
    """A block load, masked unless the block is known to be in bounds (EVEN)."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _correction_rows(row, is_run, ou, s_ot, s_oh, h, rk, rv, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Where a run's tokens sit in the summary outputs ou [N, H, V + K] (first token and count in its step
    row): pointers and masks of their u_t [BT, K] (last K columns) and of their outputs [BT, BV]."""
    t0 = tl.load(row + 4)
    nt = tl.load(row + 5)
    tt = tl.arange(0, BT)
    mt = (tt < nt) & is_run
    rows = (t0 + tt).to(tl.int64) * s_ot + h * s_oh
    uptr = ou + rows[:, None] + V + rk[None, :]
    optr = ou + rows[:, None] + rv[None, :]
    return uptr, mt[:, None] & (rk < K)[None, :], optr, mt[:, None] & (rv < V)[None, :]


@triton.jit
def _correct_or_keep(x, is_run, row, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, CORRECT: tl.constexpr, BT: tl.constexpr):
    """What a step does with x, the state entering it, when the step is a run: with CORRECT, the run's tokens'
    outputs corrected in place (o_t += x^T u_t); without, x kept at the run's `before` slot."""
    if CORRECT:
        uptr, mu, optr, mo = _correction_rows(row, is_run, ou, s_ot, s_oh, h, rk, rv, K, V, BT)
        u = tl.load(uptr, mask=mu, other=0.0)
        o0 = tl.load(optr, mask=mo, other=0.0).to(tl.float32)
        if is_run:
            corr = tl.dot(u.to(tl.float32), x, input_precision=PREC)                 # [BT, BV]
            tl.store(optr, (o0 + corr).to(ou.dtype.element_ty), mask=mo)
    else:
        slot = tl.load(row + 3)
        tl.store(before + (slot * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv & is_run)


@triton.jit
def _chain_step(x, j, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, m_kk, off_kk, off_at,
                off_as, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, W: tl.constexpr,
                CORRECT: tl.constexpr, BT: tl.constexpr, FACTORS: tl.constexpr, BF: tl.constexpr, EVEN: tl.constexpr,
                SPLIT: tl.constexpr = False):
    """Step j of a chain described by its row of `steps` (W int64 columns): T address or run offset,
    S address or run offset, is_run, slot[, first token, tokens]. A run's [S | T] lies in A (address
    a_addr) at that byte offset; with FACTORS its S [H, K, V] lies there and its transition's factors
    [H, 2 BF + 1, K] (Kd, W, gamma: T = gamma I - Kd^T W) at the first offset from f_addr, and the step is
    x <- gamma x - Kd^T (W x) + S. Without CORRECT, before[slot] <- x for runs; with it, the run's
    tokens' outputs are corrected in place instead: o_t += x^T u_t (ou: the summary's [N, H, V + K]
    outputs, u_t its last K columns), x being the run's true initial state.
    The step's loads (S; T or its factors; the correction's u and o) are issued together before any product:
    a loaded value is used only after the last load is issued (H200 runs 33-36: 1.2 ms faster on the warm
    request than loads in the order of use, with dense runs). A masked load whose mask is off reads nothing,
    so the map kind the step does not have costs no memory traffic."""
    row = steps + j.to(tl.int64) * W
    tv = tl.load(row)
    sv = tl.load(row + 1)
    is_run = _is_run(row)
    base = tl.where(is_run, a_addr, 0)
    if FACTORS:
        sp = (sv + base).to(tl.pointer_type(tl.float32))
        s = tl.load(sp + h * (K * V) + rk[:, None] * V + rv[None, :], mask=m_kv, other=0.0)
        fp = (tv + f_addr).to(tl.pointer_type(tl.float32)) + h * ((2 * BF + 1) * K)
        rf = tl.arange(0, BF)
        mf = ((rf < BF)[:, None] & (rk < K)[None, :]) & is_run
        kd = tl.load(fp + rf[:, None] * K + rk[None, :], mask=mf, other=0.0)
        wf = tl.load(fp + (BF + rf)[:, None] * K + rk[None, :], mask=mf, other=0.0)
        gam = tl.load(fp + 2 * BF * K, mask=is_run, other=0.0)
        tp = tv.to(tl.pointer_type(tl.float32))
        t = tl.load(tp + h * (K * K) + rk[:, None] * K + rk[None, :], mask=m_kk & (is_run == 0), other=0.0)
        if SPLIT:       # the cached map pre-split: T (column 0) holds its tf32 part, column 6 the rest
            tlp = tl.load(row + 6).to(tl.pointer_type(tl.float32))
            t_lo = tl.load(tlp + h * (K * K) + rk[:, None] * K + rk[None, :], mask=m_kk & (is_run == 0), other=0.0)
    else:
        t, s = _dense_map(tv, sv, is_run, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv, m_kk, K, V, EVEN)
    _correct_or_keep(x, is_run, row, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, H, K, V, PREC, CORRECT, BT)
    if FACTORS:
        if is_run:
            y = tl.dot(wf, x, input_precision=PREC)                                    # [BF, BV]
            xn = gam * x - tl.dot(tl.trans(kd), y, input_precision=PREC) + s
        else:
            if SPLIT:   # three tf32 products with T's parts as loaded: no split of T in the step
                x_hi = _trunc(x)
                x_lo = x - x_hi
                xn = tl.dot(t, x_lo, input_precision="tf32") + tl.dot(t_lo, x_hi, input_precision="tf32")
                xn = tl.dot(t, x_hi, xn, input_precision="tf32") + s
            else:
                xn = tl.dot(t, x, input_precision=PREC) + s
        return xn
    return tl.dot(t, x, input_precision=PREC) + s


@triton.jit
def _dense_rest(x, t, s, is_run, row, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, CORRECT: tl.constexpr, BT: tl.constexpr):
    """A dense step after its map (t, s) was loaded: the run's correction or its `before` slot, then T x + S (as
    _chain_step's dense form)."""
    _correct_or_keep(x, is_run, row, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, H, K, V, PREC, CORRECT, BT)
    return tl.dot(t, x, input_precision=PREC) + s


@triton.jit
def _dense_next(j, j1, steps, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv, m_kk, K: tl.constexpr,
                V: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr):
    """Step j's map (t, s) and kind, loaded ahead of the step before it (PREFETCH); past the chain's end (j = j1)
    the last step's row is read again, its values unused."""
    row = steps + tl.minimum(j, j1 - 1).to(tl.int64) * W
    tv = tl.load(row)
    sv = tl.load(row + 1)
    is_run = _is_run(row)
    t, s = _dense_map(tv, sv, is_run, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv, m_kk, K, V, EVEN)
    return t, s, is_run


@triton.jit
def _step_s(row, a_addr, h, off_kv, off_as, m_kv, K: tl.constexpr, V: tl.constexpr, FACTORS: tl.constexpr,
            EVEN: tl.constexpr):
    """A step's S block [K, BV] alone (its T not read): where `_chain_step` and `_dense_map` read it."""
    sv = tl.load(row + 1)
    is_run = _is_run(row)
    if FACTORS:
        s = tl.load((sv + tl.where(is_run, a_addr, 0)).to(tl.pointer_type(tl.float32)) + h * (K * V) + off_kv,
                    mask=m_kv, other=0.0)
    else:
        s = _dense_s(sv, is_run, a_addr, h, off_kv, off_as, m_kv, K, V, EVEN)
    return s


@triton.jit
def _trunc(v):
    """fp32 v with its low 13 mantissa bits cleared: its tf32 part, truncated (the rest, v - _trunc(v), is exact)."""
    return (v.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _tf32(v, EMULATE: tl.constexpr):
    """v as a tf32 product reads it: the wgmma instruction drops the low 13 mantissa bits of an fp32 operand (PTX ISA,
    wgmma.mma_async with .tf32); EMULATE (Triton's interpreter, whose products are exact fp32) drops them here, so the
    interpreter computes what the device does."""
    if EMULATE:
        v = _trunc(v)
    return v


@triton.jit
def _rna(v):
    """v rounded to tf32, to nearest with ties away from zero (a rounding bias on the magnitude's bits, then the low 13
    cleared; the sign bit is apart): a tf32 product reads it exactly."""
    return ((v.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _position_correct(x, j, steps, ou, s_ot, s_oh, h, rk, rv, tt, V: tl.constexpr, W: tl.constexpr,
                      EMULATE: tl.constexpr):
    """Step j's run: its tokens' outputs corrected in place from x, the state entering the run, o_t += x^T u_t (first
    token and count in the step's row), as three bf16 products (`_by_position`'s docstring)."""
    row = steps + j.to(tl.int64) * W
    t0 = tl.load(row + 4)
    nt = tl.load(row + 5)
    mt = (tt < nt)[:, None]
    rows = (t0 + tt).to(tl.int64) * s_ot + h * s_oh
    u = tl.load(ou + rows[:, None] + V + rk[None, :], mask=mt, other=0.0)
    optr = ou + rows[:, None] + rv[None, :]
    o0 = tl.load(optr, mask=mt, other=0.0).to(tl.float32)
    x1 = x.to(tl.bfloat16)                          # the correction's operand: x in three bf16 parts
    r1 = x - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
    if EMULATE:         # (Triton 3.6's interpreter multiplies bf16 blocks wrongly: the same products in fp32)
        uf = u.to(tl.float32)
        corr = tl.dot(uf, x1.to(tl.float32), input_precision="ieee")
        corr = tl.dot(uf, x2.to(tl.float32), corr, input_precision="ieee")
        corr = tl.dot(uf, x3.to(tl.float32), corr, input_precision="ieee")
    else:
        corr = tl.dot(u, x1)
        corr = tl.dot(u, x2, corr)
        corr = tl.dot(u, x3, corr)
    tl.store(optr, (o0 + corr).to(ou.dtype.element_ty), mask=mt)


@triton.jit
def _product3(m, x, EMULATE: tl.constexpr):
    """m x in fp32-level precision from three tf32 products (`_by_position`'s docstring), m [K, K] as loaded."""
    x_hi = _rna(x)
    x_lo = _rna(x - x_hi)
    m_lo = _rna(m - _trunc(m))
    acc = tl.dot(m_lo, x_hi, input_precision="tf32")           # (the small products first, the large one last)
    acc = tl.dot(_tf32(m, EMULATE), x_lo, acc, input_precision="tf32")
    return tl.dot(_tf32(m, EMULATE), x_hi, acc, input_precision="tf32")


@triton.jit
def _position_step(x, j, j0, p0, steps, maps, ou, s_ot, s_oh, h, rk, rv, tt, off_m, off_c, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, EMULATE: tl.constexpr):
    """Step j of `_by_position`: its map at slot p0 + j - j0; the run's outputs corrected from x; M x + c."""
    mp = maps + (p0 + j - j0).to(tl.int64) * (H * K * (V + K)) + h * (K * (V + K))
    m = tl.load(mp + off_m)                                                   # [K, K]
    c = tl.load(mp + off_c)                                                   # [K, BV]
    _position_correct(x, j, steps, ou, s_ot, s_oh, h, rk, rv, tt, V, W, EMULATE)
    return _product3(m, x, EMULATE) + c


@triton.jit
def _by_position(x, j0, j1, steps, maps, ou, s_ot, s_oh, h, rk, rv, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, EMULATE: tl.constexpr):
    """Steps j0..j1-1 of a chain whose every step is a run's dense map in the pairs' buffer `maps` [N, H, K, V + K]
    ([c | M] rows) at consecutive slots from row j0's (STEP_BY_POSITION), each run's outputs corrected in place.

    Step j's map lies at slot p0 + j - j0: an address the loop computes, so Triton's pipeliner issues its loads two
    steps ahead into two shared-memory buffers (the table-addressed loop waits on each row before its map's loads, and
    its kind's branch keeps the loads out of the pipeline: one [K, K] map loaded per step into registers, then split).
    The product M x in fp32-level precision from three tf32 products, M read from shared memory as loaded: the
    instruction itself drops M's low 13 bits (`_tf32`), so M's tf32 part needs no copy, and its rest M - trunc(M) is the
    one part made in registers; x = x_hi + x_lo. The parts given to the products are rounded to nearest (`_rna`), not
    left to the instruction's truncation, and the small products are summed first, the large one onto them, as Triton's
    "tf32x3" orders them (H100 runs 114-115: 1.0-1.1e-5 relative after scan_bench's 24-step chain with the large
    product first, truncated or rounded parts alike, against 2.3e-6 for "tf32x3": the tensor cores' sums lose the small
    terms' low bits when they are added to a large running sum). Left out: M's rest times x_lo (below 2^-21 of the
    term) and the parts' rounding (2^-11 of parts below 2^-10 and 2^-11 of the whole).
    A run's correction o_t += x^T u_t is three bf16 products (u_t is bf16; x as three bf16 parts, within 2^-24 of x;
    each product exact, summed in fp32): x's two tf32 parts in the correction's operand layout would not fit beside
    two maps in shared memory (239 KB at the 35B shape, 227 KB the most), its bf16 parts do."""
    tt = tl.arange(0, BT)
    # (a run's row holds its map's byte offset in the buffer)
    p0 = tl.load(steps + j0.to(tl.int64) * W, mask=j0 < j1, other=0) // (H * K * (V + K) * 4)
    off_m = rk[:, None] * (V + K) + V + rk[None, :]
    off_c = rk[:, None] * (V + K) + rv[None, :]
    if EMULATE:             # (Triton's interpreter cannot range over loaded bounds)
        j = j0
        while j < j1:
            x = _position_step(x, j, j0, p0, steps, maps, ou, s_ot, s_oh, h, rk, rv, tt, off_m, off_c, H, K, V, W,
                               EMULATE)
            j += 1
    else:
        for j in tl.range(j0, j1, num_stages=3):
            x = _position_step(x, j, j0, p0, steps, maps, ou, s_ot, s_oh, h, rk, rv, tt, off_m, off_c, H, K, V, W,
                               EMULATE)
    return x


@triton.jit
def _table_chain(x, j0, j1, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr,
                 STAGES: tl.constexpr, W: tl.constexpr, CORRECT: tl.constexpr, BT: tl.constexpr, FACTORS: tl.constexpr,
                 BF: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr):
    """Steps j0..j1-1 of a chain as its table names them (`_chain_step`). The dense maps' offsets are made here, once
    (alive only in this walk: made before a walk by position, they held ~64 registers a thread through it)."""
    m_kk = (rk < K)[:, None] & (rk < K)[None, :]
    off_kk = rk[:, None] * K + rk[None, :]
    off_at = rk[:, None] * (V + K) + V + rk[None, :]
    off_as = rk[:, None] * (V + K) + rv[None, :]
    if PREFETCH:                # dense maps: each step's map loaded during the step before it, by hand
        if j0 < j1:
            t_n, s_n, run_n = _dense_next(j0, j1, steps, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv, m_kk, K, V,
                                          W, EVEN)
            j = j0
            while j < j1:
                t, s, is_run = t_n, s_n, run_n
                t_n, s_n, run_n = _dense_next(j + 1, j1, steps, a_addr, h, off_kk, off_kv, off_at, off_as, m_kv,
                                              m_kk, K, V, W, EVEN)
                x = _dense_rest(x, t, s, is_run, steps + j.to(tl.int64) * W, before, ou, s_ot, s_oh, h, rk, rv,
                                off_kv, m_kv, H, K, V, PREC, CORRECT, BT)
                j += 1
    elif STAGES > 1:
        for j in tl.range(j0, j1, num_stages=STAGES):
            x = _chain_step(x, j, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, m_kk, off_kk,
                            off_at, off_as, H, K, V, PREC, W, CORRECT, BT, FACTORS, BF, EVEN, SPLIT)
    else:
        j = j0
        while j < j1:
            x = _chain_step(x, j, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, m_kk, off_kk,
                            off_at, off_as, H, K, V, PREC, W, CORRECT, BT, FACTORS, BF, EVEN, SPLIT)
            j += 1
    return x


@triton.jit
def _scan_steps_kernel(init, steps, a_addr, f_addr, before, final, cu, ou, s_ot, s_oh, maps, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                       STAGES: tl.constexpr, W: tl.constexpr, CORRECT: tl.constexpr, BT: tl.constexpr,
                       FACTORS: tl.constexpr, BF: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr = False,
                       PREFETCH: tl.constexpr = False, POSITION: tl.constexpr = False, EMULATE: tl.constexpr = False):
    r, h, rk, rv, m_kv, off_kv = _state_block(K, V, BK, BV)
    x = tl.load(init + (r * H + h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    j0 = tl.load(cu + r)
    j1 = tl.load(cu + r + 1)
    kind0 = tl.load(steps + j0.to(tl.int64) * W + 2, mask=j0 < j1, other=0)      # (0 for an empty chain)
    if (kind0 & _FROM_ZERO) != 0:
        # the chain starts from a zero state (its init is zero: the table's promise): its first step is its S,
        # with no product; a run's correction would add zero (CORRECT: skipped), its `before` slot is zero
        row0 = steps + j0.to(tl.int64) * W
        if not CORRECT:
            _correct_or_keep(x, _is_run(row0), row0, before, ou, s_ot, s_oh, h, rk, rv, off_kv,
                             m_kv, H, K, V, PREC, CORRECT, BT)
        x = _step_s(row0, a_addr, h, off_kv, rk[:, None] * (V + K) + rv[None, :], m_kv, K, V, FACTORS, EVEN)
        j0 += 1
    # (POSITION: compiled only for dense maps with the correction, BK = K and blocks tiling V)
    if POSITION and (kind0 & _BY_POSITION) != 0:
        if (kind0 & _FROM_ZERO) == 0:       # the first step as its row names it, the rest by position
            x = _table_chain(x, j0, j0 + 1, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv,
                             m_kv, H, K, V, PREC, 1, W, CORRECT, BT, FACTORS, BF, EVEN, SPLIT, False)
            j0 += 1
        x = _by_position(x, j0, j1, steps, maps, ou, s_ot, s_oh, h, rk, rv, H, K, V, W, BT, EMULATE)
    else:
        x = _table_chain(x, j0, j1, steps, a_addr, f_addr, before, ou, s_ot, s_oh, h, rk, rv, off_kv, m_kv, H, K,
                         V, PREC, STAGES, W, CORRECT, BT, FACTORS, BF, EVEN, SPLIT, PREFETCH)
    tl.store(final + (r * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv)


# scan_steps' dense form with each step's map loaded during the step before it (`_dense_next`), against Triton's own
# pipelining of the loop, which a branch on the map's kind may defeat: off until measured on the GPU (gpu_bench's
# variant `scan_prefetch`, docs/gpu-notes.md "Twenty-third session")
PREFETCH = False
# the compose pass's chains whose steps after the first are the pairs' maps in order (STEP_BY_POSITION, set by
# layers/linear.py) walked by position, two maps in flight (`_by_position`); off: every chain as its table names it
BY_POSITION = True

COMPILED: dict = {}          # the last launched compiled kernel per kind ("steps"): its n_regs / n_spills for gpu_check

_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:                      # (Triton's interpreter runs on the CPU: count a full H200)
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _SMS[device]


# (value block, warps, pipeline stages) tried on a shape's first eager call; the first is the run-12 default.
# (At 8 warps the factored, corrected step-table kernel uses 255 registers and spills: run 30, 60 values with
# the loads first, 34 in order of use. H200 run 40 held the state in two halves of K and multiplied by quarters of
# T, a quarter's tf32x3 split at a time: 363 against 296 us per layer, removed. 16 warps, tried in run 31, hit an
# illegal memory access in the factored scan on the H200 (Triton 3.6), not investigated: not tried. H200 run 55
# (benchmarks/scan_bench.py --wide): 16 warps cap registers at 128 and still spill; the dense chain 592 us against 352
# at (32, 8, 2); a seam run paired with the next segment in one step faulted at 16 warps. Run 54: the state held
# transposed (x^T as every product's left operand, code at git 4a0a8c6) 418 us at best, and (64, 8, 1) miscompiled.)
_CONFIGS = ((32, 8, 1), (64, 8, 1), (32, 4, 2), (32, 8, 2), (64, 8, 2), (16, 4, 2))
TUNED: dict = {}              # shape key -> (bv, warps, stages), with the timings (benchmarks print them)


def _default(r: int, h: int, v: int, device) -> tuple[int, int, int]:
    # one program per (request, head, block of 64 value columns); with too few of them to fill half the
    # SMs (one request: 1 x 32 heads x 2 blocks = 64 programs on 132 SMs) blocks of 32 double the
    # programs at the cost of reading each T twice (run 3 / 5: 64 was faster with 3 requests = 96)
    return (32 if r * h * triton.cdiv(v, 64) < _sm_count(device) // 2 else 64), 8, 1


def _tuned(key, device, launch, fallback, out) -> tuple[int, int, int]:
    """The fastest configuration for this shape (ops/tuning.py); fp32 outputs: one that differs from the first
    configuration's by more than 1e-5 relative is never chosen."""
    return tuned_config(TUNED, key, _CONFIGS, device, launch, out, fallback, 1e-5)


def scan_dense(init: torch.Tensor, T: torch.Tensor, S: torch.Tensor, cu, *, order=None, runs=None,
               runs_only: bool = False, bv: int | None = None, warps: int | None = None, stages: int | None = None,
               tune: bool = True, precision: str = "tf32x3"):
    """init [R, H, K, V], T [M, H, K, K], S [M, H, K, V] (fp32), cu [R + 1] -> (before, final [R, H, K, V]).
    cu: a list or an int32 device tensor; order [M'] int32 (device, optional): map j is slot order[j].
    runs [N, H, K, V + K] (optional, fp32 contiguous): slots M .. M + N - 1 are these runs' [S | T] (the
    appended-identity kernel's final states), read in place; before then has M + N slots.
    runs_only: before[m] is written for the runs' slots only (the others are left as they are).
    bv / warps / stages: a fixed configuration (else the tuned one, or the default when tune is False)."""
    r, h, k, v = init.shape
    init, T, S = init.float().contiguous(), T.float().contiguous(), S.float().contiguous()
    e = T.shape[0]
    slots = e + (0 if runs is None else runs.shape[0])
    before = init.new_empty((slots, h, k, v))
    final = torch.empty_like(init)
    if slots == 0:
        final.copy_(init)
        return before, final
    if runs is not None and not (runs.is_contiguous() and runs.dtype == torch.float32 and runs.shape[-1] == v + k):
        raise ValueError("runs must be fp32, contiguous, [N, H, K, V + K]")
    bk = max(16, triton.next_power_of_2(k))
    cu_t = cu if torch.is_tensor(cu) else torch.tensor(cu, dtype=torch.int32).to(init.device, non_blocking=True)

    def launch(cfg):
        b, w, st = cfg
        _scan_kernel[(r, h, triton.cdiv(v, b))](
            init, T, S, S if runs is None else runs, before, final, cu_t, cu_t if order is None else order, e,
            H=h, K=k, V=v, BK=bk, BV=b, PREC=precision, ORDER=order is not None, RUNS=runs is not None,
            RUNS_ONLY=runs_only and runs is not None, STAGES=st, num_warps=w)

    cfg = _default(r, h, v, init.device)
    if bv is not None or warps is not None or stages is not None:
        cfg = (bv or cfg[0], warps or cfg[1], stages or cfg[2])
    elif tune:
        key = (r, h, k, v, order is not None, runs is not None, precision)
        cfg = _tuned(key, init.device, launch, cfg, final)
    launch(cfg)
    return before, final


def split_tf32(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 t as (its tf32 part: the low 13 mantissa bits cleared, the rest t - that), exactly t in sum: the two
    parts of a cached map that `scan_steps(split=True)` reads."""
    hi = (t.float().contiguous().view(torch.int32) & -8192).view(torch.float32)
    return hi, (t.float() - hi).contiguous()


def position_fits(k: int, bv: int) -> bool:
    """`_by_position` keeps two [K, K] maps and two [K, BV] blocks of c in shared memory beside x's parts: whether that
    fits the H200's 227 KB (sm_90a builds at K = 128: 207 KB at BV = 32, 274 KB at 64, which would not build)."""
    return 8 * k * (k + bv) + 6 * k * bv + 16384 <= 232448


def scan_steps(init: torch.Tensor, steps: torch.Tensor, cu: torch.Tensor, runs: torch.Tensor, slots: int, *,
               outputs: torch.Tensor | None = None, max_run: int = 16, factors: torch.Tensor | None = None,
               split: bool = False, bv: int | None = None, warps: int | None = None, stages: int | None = None,
               tune: bool = True, precision: str = "tf32x3", prefetch: bool | None = None,
               position: bool | None = None):
    """The compose pass's form: chains described step by step, no map copied.

    init [R, H, K, V] fp32; steps [M, 4] (or [M, 6]) int64 (device), row j = chain step j in sequence order:
    (T address, S address, 0, slot[, 0, 0]) for a cached map (its own fp32 contiguous T [H, K, K] and
    S [H, K, V]), (byte offset, byte offset, 1, slot[, first token, tokens]) for a run, whose [S | T] is
    runs[i] [H, K, V + K] (fp32, contiguous; offset i * H * K * (V + K) * 4); cu [R + 1] int32 (device):
    chain r is steps cu[r]..cu[r+1]-1.
    factors (optional) [N, H, 2 w + 1, K] fp32 contiguous: the runs' transitions in factored form (reference
    `run_factors`); runs is then S [N, H, K, V], and a run's row holds (its factors' byte offset i * H * (2 w + 1)
    * K * 4, its S's i * H * K * V * 4, 1, ...).
    outputs (optional, needs the 6-column table): the run summaries' outputs [N, H, V + K] (o_t(0) in the first
    V columns, u_t in the last K), corrected in place to the runs' true initial states, o_t = o_t(0) +
    S0^T u_t, runs of at most max_run tokens; `before` is then not written.
    A chain's first row may carry STEP_FROM_ZERO (compose/scan.py) in its kind column (0 or 1 | 2): its init is then
    zero, and the step is x <- S (no product, no correction; its `before` slot written zero).
    split (with factors; a 7-column table or wider): each cached map comes pre-split (`split_tf32`), its T address
    (column 0) naming T's tf32 part and column 6 the rest, and its step is three tf32 products of those with the
    state's two parts, so no split of T happens in the step and both parts can feed the products from shared memory
    (an experiment: benchmarks/scan_bench.py `split`; no cache keeps split maps).
    prefetch (dense maps only; None: the module's PREFETCH): each step's map loaded during the step before it; the
    pipeline depth (stages) is then unused.
    position (dense maps with bf16 `outputs`, not prefetch or split; None: the module's BY_POSITION): a chain whose
    first row carries STEP_BY_POSITION (compose/scan.py) takes the steps after its first by position in `runs` (the
    low-rank pairs' buffer, `_by_position`); other chains as their rows name them.
    Returns (before [slots, H, K, V]: written at the runs' slots only, unless `outputs`; final [R, H, K, V])."""
    r, h, k, v = init.shape
    prefetch = (PREFETCH and factors is None) if prefetch is None else prefetch      # (the module's: dense maps only)
    # (by position on CUDA: the correction's products take u_t in bf16, as the compose pass's summaries write it; fp32
    # outputs go the table's way. Triton's interpreter makes the same products in fp32.)
    position = (BY_POSITION if position is None else position) and factors is None and outputs is not None \
        and not prefetch and not split and (outputs.dtype == torch.bfloat16 or not init.is_cuda)
    if prefetch and factors is not None:
        raise ValueError("prefetch is for dense maps (no factors)")
    init = init.float().contiguous()
    width = v if factors is not None else v + k
    if not (runs.is_contiguous() and runs.dtype == torch.float32 and runs.shape[-1] == width):
        raise ValueError(f"runs must be fp32, contiguous, [N, H, K, {width}]")
    bf = 16
    if factors is not None:
        bf = (factors.shape[-2] - 1) // 2
        if not (factors.is_contiguous() and factors.dtype == torch.float32 and factors.shape[-1] == k
                and factors.shape[-2] == 2 * bf + 1 and bf >= 16):
            raise ValueError("factors must be fp32, contiguous, [N, H, 2 w + 1, K] with w >= 16")
    if split and (factors is None or steps.shape[1] < 7):
        raise ValueError("split needs factors and a step table of at least 7 columns")
    correct = outputs is not None
    if correct and (steps.shape[1] < 6 or outputs.shape[1:] != (h, v + k) or outputs.stride(-1) != 1
                    or outputs.stride(1) != v + k):
        raise ValueError("outputs must be [N, H, V + K] with rows of V + K, and steps need 6 columns")
    before = init.new_empty((slots, h, k, v))
    final = torch.empty_like(init)
    bk = max(16, triton.next_power_of_2(k))
    a_addr = runs.data_ptr()
    f_addr = factors.data_ptr() if factors is not None else 0
    ou = outputs if correct else final
    s_ot, s_oh = (outputs.stride(0), outputs.stride(1)) if correct else (0, 0)

    bt = max(16, triton.next_power_of_2(max_run))

    def launch(cfg, _o=ou):
        b, w, st = cfg
        even = bk == k and v % b == 0
        fits = position_fits(k, b)
        COMPILED["steps"] = _scan_steps_kernel[(r, h, triton.cdiv(v, b))](
            init, steps, a_addr, f_addr, before, final, cu, _o, s_ot, s_oh, runs, H=h, K=k, V=v, BK=bk, BV=b,
            PREC=precision, STAGES=1 if prefetch else st, W=steps.shape[1], CORRECT=correct, BT=bt,
            FACTORS=factors is not None, BF=bf, EVEN=even, SPLIT=split, PREFETCH=prefetch,
            POSITION=position and even and fits, EMULATE=not init.is_cuda, num_warps=w)

    cfg = _default(r, h, v, init.device)
    form = ("steps+prefetch" if prefetch else "steps" + ("+position" if position else "")) if factors is None else (
        "steps+factors" + ("+split" if split else ""))
    if bv is not None or warps is not None or stages is not None:
        cfg = (bv or cfg[0], warps or cfg[1], stages or cfg[2])
    elif tune and not correct:
        cfg = _tuned((form, r, h, k, v, precision), init.device, launch, cfg, final)
    elif tune:
        # the corrected outputs are written in place: tuning runs the kernel several times, so it times a
        # copy of them, then the chosen configuration runs once on the real ones. The copy is made by the first
        # trial: once tuned (or while a graph is captured) no trial runs, and no copy is queued (it had been, on
        # every call: [256, 32, 256] per layer, 30 launches of ~4.3 us in H100 run 121's eager profile, and in
        # the captured graphs)
        scratch = []

        def trial(cfg):
            if scratch:
                scratch[0].copy_(outputs)
            else:
                scratch.append(outputs.clone())
            launch(cfg, scratch[0])

        cfg = _tuned((form + "+correct", r, h, k, v, precision), init.device, trial, cfg, final)
    launch(cfg)
    return before, final


@triton.jit
def _pair_row(pairs, F, p, h, r, H: tl.constexpr, K: tl.constexpr, WF: tl.constexpr, PW: tl.constexpr,
              SKIP: tl.constexpr):
    """Pair row p: its cached map's T and S addresses (0: none), its run's index i (factors, U and output slot),
    whether a cached map follows, the store mask of rows r (rows past K; every row where SKIP and the row is marked),
    and the run's factors for head h."""
    row = pairs + p.to(tl.int64) * PW
    tv = tl.load(row)
    sv = tl.load(row + 1)
    i = tl.load(row + 2)
    mr = (r < K)[:, None]
    if SKIP:
        mr = mr & (tl.load(row + 3) == 0)
    fb = F + (i * H + h).to(tl.int64) * ((2 * WF + 1) * K)
    return tv, sv, i, tv != 0, mr, fb


@triton.jit
def _aligned(base, addr, cached, ALIGNED: tl.constexpr):
    """An fp32 pointer to the cached map's byte address `addr` (16-byte aligned: cache/entry.py `addresses`, else the
    fill's copies), read 16 bytes at a time (ops/triton_address.py; base: the aligned output). Without ALIGNED
    (PAIR_ALIGNED off), the address as an integer, as before the thirty-sixth session."""
    if ALIGNED:
        ptr = from_address(base, addr, cached)
    else:
        ptr = tl.where(cached, addr, 0).to(tl.pointer_type(tl.float32))
    return ptr


@triton.jit
def _pair_lowrank_kernel(pairs, F, U, out, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WF: tl.constexpr,
                         BR: tl.constexpr, PREC: tl.constexpr, PW: tl.constexpr, HALVES: tl.constexpr,
                         BC: tl.constexpr = 0, SKIP: tl.constexpr = False, FIRST: tl.constexpr = False,
                         ALIGNED: tl.constexpr = True):
    """Program (pair row p, head h, block of BR rows of the map): rows of [c | M] = [S_e + P U | g T_e - P W],
    P = T_e Kd^T (T_e = I, S_e = 0 where the row names no cached map). HALVES: two programs per block, one for M
    and one for c (each forms P; the pair's two programs are adjacent in launch order, so T_e's second read is
    likely an L2 hit), about half the live registers of one program doing both. BC > 0: the columns in chunks of
    BC (P accumulated over T_e's column chunks, then M's and c's chunks each formed and stored), T_e's rows read
    twice (the second from cache, likely), few live registers (`_pair_chunked`). SKIP: a row whose fourth column is
    not zero writes nothing (the compose pass's pad runs, when no chain reads their maps). FIRST: every load of the
    program issued before its first product (`_pair_first`)."""
    if BC > 0:
        _pair_chunked(pairs, F, U, out, H, K, V, WF, BR, PREC, PW, BC, SKIP, ALIGNED)
        return
    if FIRST:
        _pair_first(pairs, F, U, out, H, K, V, WF, BR, PREC, PW, SKIP, ALIGNED)
        return
    if HALVES:
        part = tl.program_id(0) % 2
        p = tl.program_id(0) // 2
    else:
        part = 2
        p = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2) * BR + tl.arange(0, BR)
    tv, sv, i, cached, mr, fb = _pair_row(pairs, F, p, h, r, H, K, WF, PW, SKIP)
    kk = tl.arange(0, K)
    vv = tl.arange(0, V)
    ww = tl.arange(0, WF)
    kd = tl.load(fb + ww[:, None] * K + kk[None, :])                                   # [WF, K]
    tp = _aligned(out, tv, cached, ALIGNED) + h * (K * K)
    te = tl.load(tp + r[:, None] * K + kk[None, :], mask=cached & (r < K)[:, None], other=0.0)     # [BR, K]
    te = tl.where(cached, te, tl.where(r[:, None] == kk[None, :], 1.0, 0.0))
    pk = tl.dot(te, tl.trans(kd), input_precision=PREC)                                # [BR, WF]
    ob = out + (i * H + h).to(tl.int64) * (K * (V + K)) + r[:, None] * (V + K)
    if part != 1:                                         # M = g T_e - P W
        wf = tl.load(fb + (WF + ww)[:, None] * K + kk[None, :])                        # [WF, K]
        g = tl.load(fb + 2 * WF * K)
        m = g * te - tl.dot(pk, wf, input_precision=PREC)
        tl.store(ob + V + kk[None, :], m, mask=mr)
    if part != 0:                                         # c = S_e + P U
        sp = _aligned(out, sv, cached, ALIGNED) + h * (K * V)
        se = tl.load(sp + r[:, None] * V + vv[None, :], mask=cached & (r < K)[:, None], other=0.0)     # [BR, V]
        u = tl.load(U + (i * H + h).to(tl.int64) * (WF * V) + ww[:, None] * V + vv[None, :])   # [WF, V]
        c = se + tl.dot(pk, u, input_precision=PREC)
        tl.store(ob + vv[None, :], c, mask=mr)


@triton.jit
def _pair_chunked(pairs, F, U, out, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WF: tl.constexpr,
                  BR: tl.constexpr, PREC: tl.constexpr, PW: tl.constexpr, BC: tl.constexpr, SKIP: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """_pair_lowrank_kernel's program with the columns in chunks of BC (K and V multiples of BC)."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2) * BR + tl.arange(0, BR)
    # (loads of T_e and S_e below are masked by mr: a skipped row loads nothing)
    tv, sv, i, cached, mr, fb = _pair_row(pairs, F, p, h, r, H, K, WF, PW, SKIP)
    cc = tl.arange(0, BC)
    ww = tl.arange(0, WF)
    tp = _aligned(out, tv, cached, ALIGNED) + h * (K * K) + r[:, None] * K
    pk = tl.zeros((BR, WF), dtype=tl.float32)
    for c0 in tl.static_range(0, K, BC):                  # P = T_e Kd^T over T_e's column chunks
        te = tl.load(tp + (c0 + cc)[None, :], mask=cached & mr, other=0.0)
        te = tl.where(cached, te, tl.where(r[:, None] == (c0 + cc)[None, :], 1.0, 0.0))
        kd = tl.load(fb + ww[:, None] * K + (c0 + cc)[None, :])                        # [WF, BC]
        pk = tl.dot(te, tl.trans(kd), pk, input_precision=PREC)
    g = tl.load(fb + 2 * WF * K)
    ob = out + (i * H + h).to(tl.int64) * (K * (V + K)) + r[:, None] * (V + K)
    for c0 in tl.static_range(0, K, BC):                  # M = g T_e - P W
        te = tl.load(tp + (c0 + cc)[None, :], mask=cached & mr, other=0.0)
        te = tl.where(cached, te, tl.where(r[:, None] == (c0 + cc)[None, :], 1.0, 0.0))
        wf = tl.load(fb + (WF + ww)[:, None] * K + (c0 + cc)[None, :])
        tl.store(ob + V + (c0 + cc)[None, :], g * te - tl.dot(pk, wf, input_precision=PREC), mask=mr)
    sp = _aligned(out, sv, cached, ALIGNED) + h * (K * V) + r[:, None] * V
    ub = U + (i * H + h).to(tl.int64) * (WF * V) + ww[:, None] * V
    for c0 in tl.static_range(0, V, BC):                  # c = S_e + P U
        se = tl.load(sp + (c0 + cc)[None, :], mask=cached & mr, other=0.0)
        u = tl.load(ub + (c0 + cc)[None, :])
        tl.store(ob + (c0 + cc)[None, :], se + tl.dot(pk, u, input_precision=PREC), mask=mr)


@triton.jit
def _pair_first(pairs, F, U, out, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WF: tl.constexpr,
                BR: tl.constexpr, PREC: tl.constexpr, PW: tl.constexpr, SKIP: tl.constexpr, ALIGNED: tl.constexpr):
    """_pair_lowrank_kernel's whole-row program with every load (T_e and S_e rows, Kd, W, g, U) issued before the first
    product, so a program waits on memory once, not three times (load, product, load, ...: the whole form loads W
    after P's product and S_e, U after M's). Each program's live loads: [BR, K] + [BR, V] + 3 [WF, K or V] floats."""
    _pair_item(pairs, F, U, out, tl.program_id(0), tl.program_id(1), tl.program_id(2) * BR + tl.arange(0, BR), H, K,
               V, WF, PREC, PW, SKIP, ALIGNED)


@triton.jit
def _pair_item(pairs, F, U, out, p, h, r, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WF: tl.constexpr,
               PREC: tl.constexpr, PW: tl.constexpr, SKIP: tl.constexpr, ALIGNED: tl.constexpr):
    """Rows r of pair row p's map for head h, every load before the first product (`_pair_first`'s body)."""
    tv, sv, i, cached, mr, fb = _pair_row(pairs, F, p, h, r, H, K, WF, PW, SKIP)
    kk = tl.arange(0, K)
    vv = tl.arange(0, V)
    ww = tl.arange(0, WF)
    tp = _aligned(out, tv, cached, ALIGNED) + h * (K * K)
    sp = _aligned(out, sv, cached, ALIGNED) + h * (K * V)
    kd = tl.load(fb + ww[:, None] * K + kk[None, :])                                   # [WF, K]
    te = tl.load(tp + r[:, None] * K + kk[None, :], mask=cached & (r < K)[:, None], other=0.0)     # [BR, K]
    wf = tl.load(fb + (WF + ww)[:, None] * K + kk[None, :])                            # [WF, K]
    g = tl.load(fb + 2 * WF * K)
    se = tl.load(sp + r[:, None] * V + vv[None, :], mask=cached & (r < K)[:, None], other=0.0)     # [BR, V]
    u = tl.load(U + (i * H + h).to(tl.int64) * (WF * V) + ww[:, None] * V + vv[None, :])   # [WF, V]
    te = tl.where(cached, te, tl.where(r[:, None] == kk[None, :], 1.0, 0.0))
    pk = tl.dot(te, tl.trans(kd), input_precision=PREC)                                # [BR, WF]
    ob = out + (i * H + h).to(tl.int64) * (K * (V + K)) + r[:, None] * (V + K)
    tl.store(ob + V + kk[None, :], g * te - tl.dot(pk, wf, input_precision=PREC), mask=mr)
    tl.store(ob + vv[None, :], se + tl.dot(pk, u, input_precision=PREC), mask=mr)


@triton.jit
def _pair_persistent_kernel(pairs, F, U, out, P, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WF: tl.constexpr,
                            BR: tl.constexpr, PREC: tl.constexpr, PW: tl.constexpr, SKIP: tl.constexpr,
                            ALIGNED: tl.constexpr, STAGES: tl.constexpr):
    """`_pair_first`'s items (pair row, head, block of BR rows) walked by a fixed grid of programs, each taking every
    num_programs-th item in a loop Triton pipelines (STAGES > 1): an item's loads are issued while the item before it
    is multiplied, where one program per item waits on its own loads, then on its products, with few programs resident
    per SM (255 registers). H100 run 120: the one-program-per-item kernel still took 45 us a layer with its rows
    reading and writing nothing, about half its time: its cost is latency more than bytes."""
    nb: tl.constexpr = (K + BR - 1) // BR
    n = P * H * nb
    if STAGES > 1:
        for it in tl.range(tl.program_id(0), n, tl.num_programs(0), num_stages=STAGES):
            _pair_item(pairs, F, U, out, it // (H * nb), it // nb % H, it % nb * BR + tl.arange(0, BR), H, K, V, WF,
                       PREC, PW, SKIP, ALIGNED)
    else:                   # (Triton's interpreter cannot range over a runtime bound with stages)
        it = tl.program_id(0)
        while it < n:
            _pair_item(pairs, F, U, out, it // (H * nb), it // nb % H, it % nb * BR + tl.arange(0, BR), H, K, V, WF,
                       PREC, PW, SKIP, ALIGNED)
            it += tl.num_programs(0)


# (block rows, warps, form: False (whole rows) / True (halves) / a column chunk width / "first" (whole rows, every
# load before the first product, `_pair_first`: thirty-fourth session)) tried on a shape's first eager call; the first
# is the default. H100 run 99 (scan_bench, us per layer at the warm request's shape): chunks of 32 at (128, 8) 135.5,
# at (64, 4) 160.1; whole at (32, 4) 167.2 (run 98: whole at (16, 4), (64, 8), (32, 8) 196-232); halves 174-236.
# The engine's tuner, H100 runs 112-116: "first" (32, 4) picked in 112 and 114 (126.3, 119.1 us), (64, 4, 32) in 115
# and 116 (139.1, 131.9; "first" 151.1, 138.7): a tie
# "persist3": "first"'s items by a fixed grid of programs, each walking its items in a pipelined loop (three stages;
# `_pair_persistent_kernel`, thirty-seventh session). H100 runs 121-123, the tuner at the warm request's shape: (32, 4,
# "persist3") 112.5-123.1 us a layer against 120.7-129.9 for (32, 4, "first"), picked in every run; in the graph pairs
# 2.77 -> 2.45 ms (run 121). The (64, 8) persistent form is the slowest (165-177 us)
PAIR_CONFIGS = ((128, 8, 32), (64, 4, 32), (32, 4, False), (64, 4, True),     # (each built and run in run 99)
                (32, 4, "first"), (64, 8, "first"), (32, 4, "persist3"), (64, 8, "persist3"))
PAIR_TUNED: dict = {}
# the cached maps' rows read 16 bytes at a time (`_aligned`: their addresses made relative to an aligned pointer
# argument, so the compiler knows their alignment; thirty-sixth session. H100 run 118: gpu_bench's variant
# `loads_by_element`, which turns it off with triton_place.ALIGNED_ENTRIES, +0.22 ms on the warm request, paired)
PAIR_ALIGNED = True


def pair_form(form) -> tuple[bool, int, bool]:
    """A PAIR_CONFIGS form as _pair_lowrank_kernel's (HALVES, BC, FIRST): True halves, an int column chunks of that
    width, "first" every load first, False whole rows (a "persist<stages>" form: `pair_stages`)."""
    if pair_stages(form):
        return False, 0, True
    first = form == "first"
    halves = form is True
    return halves, 0 if isinstance(form, bool) or first else int(form), first


def pair_stages(form) -> int:
    """The pipeline stages of a "persist<stages>" form (`_pair_persistent_kernel`), 0 for the other forms."""
    return int(form[7:]) if isinstance(form, str) and form.startswith("persist") else 0


def pair_lowrank(pairs: torch.Tensor, factors: torch.Tensor, U: torch.Tensor, out: torch.Tensor, *,
                 block_rows: int | None = None, warps: int | None = None, halves: bool | int | None = None,
                 tune: bool = True, skip_marked: bool = False, precision: str | None = None) -> torch.Tensor:
    """Seam runs composed with the cached segment after them from the runs' low-rank factors (the compose pass's
    LOWRANK_PAIRS, layers/linear.py; benchmarks/scan_bench.py `lowrank` times it alone).

    A run of w <= WF tokens from zero has T_r = g I - Kd^T W and S_r = Kd^T U (factors [N, H, 2 WF + 1, K] as
    reference `run_factors` lays them out, U [N, H, WF, V] the WY-solved values, rows past a run's length zero); the
    cached map (T_e, S_e) after it makes the pair's map T_e T_r, T_e S_r + S_e, which is, with P = T_e Kd^T [K, WF],

        [c | M] = [S_e + P U | g T_e - P W]

    three thin products per row block instead of a dense [K, K] x [K, V + K] one (reference `pair_maps`). pairs
    [P, >= 4] int64 (device, rows contiguous): (T_e address, S_e address, run index i, skip) per pair (skip_marked:
    a row whose skip is not zero writes nothing), T_e [H, K, K] and S_e [H, K, V] fp32 contiguous; address 0: the run
    alone (T_e = I, S_e = 0: its own dense [S_r | T_r]). Writes out[i] [H, K, V + K] (fp32, contiguous), where the
    chain scan reads a run's [S | T]. precision: tl.dot's (default: "tf32x3" on CUDA, fp32-level products on tensor
    cores: compiled for sm_90a offline, 255 registers and no spills at 32 rows and 4 warps, where "ieee" spills 368
    bytes; "ieee" in Triton's interpreter). block_rows / warps / halves (True: two programs per row block, one for M
    and one for c; an int: the columns in chunks of that width, `_pair_chunked`; "first": whole rows with every load
    issued before the first product, `_pair_first`; "persist<stages>": those items by a fixed grid in a pipelined loop,
    `_pair_persistent_kernel`): a fixed configuration (else the
    tuned one of PAIR_CONFIGS, timed on the shape's first eager CUDA call; else the first whose column chunks tile K
    and V)."""
    n, h, rows, k = factors.shape
    wf = (rows - 1) // 2
    v = U.shape[-1]
    if not (factors.is_contiguous() and U.is_contiguous() and out.is_contiguous() and U.shape == (n, h, wf, v)
            and out.shape[1:] == (h, k, v + k) and out.dtype == torch.float32 and wf >= 16):
        raise ValueError("factors [N, H, 2 WF + 1, K], U [N, H, WF, V], out [*, H, K, V + K] fp32 contiguous, WF >= 16")
    if pairs.dim() != 2 or pairs.shape[1] < 4 or pairs.stride(1) != 1 or pairs.dtype != torch.int64:
        raise ValueError("pairs must be int64 [P, >= 4] with contiguous rows")
    prec = precision or ("tf32x3" if out.is_cuda else "ieee")

    def launch(cfg):
        br, w, hv = cfg
        halves_, bc, first = pair_form(hv)
        if bc and (k % bc or v % bc):
            raise ValueError(f"column chunks of {bc} must tile K = {k} and V = {v}")
        stages = pair_stages(hv)
        if stages:          # two programs per SM at most, each walking every grid-th item
            items = pairs.shape[0] * h * triton.cdiv(k, br)
            _pair_persistent_kernel[(min(items, 2 * _sm_count(out.device)),)](
                pairs, factors, U, out, pairs.shape[0], H=h, K=k, V=v, WF=wf, BR=br, PW=pairs.stride(0), PREC=prec,
                SKIP=skip_marked, ALIGNED=PAIR_ALIGNED, STAGES=stages if out.is_cuda else 1, num_warps=w)
            return
        _pair_lowrank_kernel[(pairs.shape[0] * (2 if halves_ else 1), h, triton.cdiv(k, br))](
            pairs, factors, U, out, H=h, K=k, V=v, WF=wf, BR=br, PW=pairs.stride(0), PREC=prec, HALVES=halves_,
            BC=bc, SKIP=skip_marked, FIRST=first, ALIGNED=PAIR_ALIGNED, num_warps=w)

    if not pairs.shape[0]:
        return out
    # the default: the first configuration whose column chunks (if any) tile K and V (the tiny presets: 16)
    def tiles(c):
        bc = pair_form(c[2])[1]
        return not bc or (k % bc == 0 and v % bc == 0)

    cfg = next((c for c in PAIR_CONFIGS if tiles(c)), (32, 4, False))
    if block_rows is not None or warps is not None or halves is not None:
        cfg = (block_rows or cfg[0], warps or cfg[1], cfg[2] if halves is None else halves)
    elif tune:
        cfg = tuned_config(PAIR_TUNED, (pairs.shape[0], h, k, v, wf, prec, skip_marked), PAIR_CONFIGS, out.device,
                           launch, out, cfg, 1e-5)
    launch(cfg)
    return out


@triton.jit
def _pair_step(x, j, i, steps, pairs, F, U, base, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk, off_kv, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WF: tl.constexpr, PW: tl.constexpr,
               PREC: tl.constexpr, EMULATE: tl.constexpr):
    """Step j of `_scan_pairs_kernel`: run i (its pair row: the cached map after it by address, or none) taken whole
    from x, the state entering it. The run's outputs corrected from x (`_position_correct`); the run itself from its
    factors, y = T_r x + S_r = g x + Kd^T (U - W x) (two thin products); then the cached map, T_e y + S_e (three tf32
    products, `_product3`), or y where none follows. Every load is issued before the first product."""
    prow = pairs + i.to(tl.int64) * PW
    tv = tl.load(prow)
    sv = tl.load(prow + 1)
    cached = tv != 0
    te = tl.load(from_address(base, tv, cached) + h * (K * K) + off_kk, mask=cached, other=0.0)        # [K, K]
    se = tl.load(from_address(base, sv, cached) + h * (K * V) + off_kv, mask=cached, other=0.0)        # [K, BV]
    fb = F + (i * H + h).to(tl.int64) * ((2 * WF + 1) * K)
    kd = tl.load(fb + ww[:, None] * K + rk[None, :])                                                   # [WF, K]
    wf = tl.load(fb + (WF + ww)[:, None] * K + rk[None, :])                                            # [WF, K]
    g = tl.load(fb + 2 * WF * K)
    uv = tl.load(U + (i * H + h).to(tl.int64) * (WF * V) + ww[:, None] * V + rv[None, :])              # [WF, BV]
    _position_correct(x, j, steps, ou, s_ot, s_oh, h, rk, rv, tt, V, W, EMULATE)
    d = uv - tl.dot(wf, x, input_precision=PREC)
    y = g * x + tl.dot(tl.trans(kd), d, input_precision=PREC)
    return tl.where(cached, _product3(te, y, EMULATE) + se, y)


@triton.jit
def _pair_table_step(x, j, steps, pairs, F, U, base, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk, off_kv,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WF: tl.constexpr,
                     PW: tl.constexpr, PREC: tl.constexpr, EMULATE: tl.constexpr):
    """Step j as its row names it: a run (its index from the row's offset into the pairs' map buffer, as the paired
    table writes it) by `_pair_step`; a cached map alone (none of the runs' pairs) by its own T and S."""
    row = steps + j.to(tl.int64) * W
    tv = tl.load(row)
    if _is_run(row):
        xn = _pair_step(x, j, tv // (H * K * (V + K) * 4), steps, pairs, F, U, base, ou, s_ot, s_oh, h, rk, rv, tt,
                        ww, off_kk, off_kv, H, K, V, W, WF, PW, PREC, EMULATE)
    else:
        t = tl.load(tv.to(tl.pointer_type(tl.float32)) + h * (K * K) + off_kk)
        s = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.float32)) + h * (K * V) + off_kv)
        xn = _product3(t, x, EMULATE) + s
    return xn


@triton.jit
def _scan_pairs_kernel(init, steps, pairs, F, U, final, cu, ou, s_ot, s_oh, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, WF: tl.constexpr,
                       PW: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr):
    """`scan_pairs`: program (chain r, value head h, block of BV value columns) walks chain r's steps, each run with
    the cached map after it taken in one step from the run's factors and the map's own (T_e, S_e), read in place."""
    r, h, rk, rv, m_kv, off_kv = _state_block(K, V, K, BV)
    off_kk = rk[:, None] * K + rk[None, :]
    tt = tl.arange(0, BT)
    ww = tl.arange(0, WF)
    x = tl.load(init + (r * H + h).to(tl.int64) * K * V + off_kv)
    j0 = tl.load(cu + r)
    j1 = tl.load(cu + r + 1)
    kind0 = tl.load(steps + j0.to(tl.int64) * W + 2, mask=j0 < j1, other=0)      # (0 for an empty chain)
    # a chain whose first step is a cached map from a zero state (the table's promise): that step is its S, no product
    # (a run from zero is the general step on x = 0, exact)
    s_first = ((kind0 & _FROM_ZERO) != 0) & ((kind0 & 1) == 0)
    if s_first:
        sv = tl.load(steps + j0.to(tl.int64) * W + 1)
        x = tl.load(sv.to(tl.pointer_type(tl.float32)) + h * (K * V) + off_kv)
        j0 += 1
    if (kind0 & _BY_POSITION) != 0:
        if not s_first:             # the first step as its row names it
            x = _pair_table_step(x, j0, steps, pairs, F, U, final, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk, off_kv,
                                 H, K, V, W, WF, PW, PREC, EMULATE)
            j0 += 1
        # every later step a run, at consecutive run indices from row j0's: no table row read for the maps' addresses
        # beyond the pair rows themselves
        i0 = tl.load(steps + j0.to(tl.int64) * W, mask=j0 < j1, other=0) // (H * K * (V + K) * 4)
        if EMULATE:             # (Triton's interpreter cannot range over loaded bounds)
            j = j0
            while j < j1:
                x = _pair_step(x, j, i0 + j - j0, steps, pairs, F, U, final, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk,
                               off_kv, H, K, V, W, WF, PW, PREC, EMULATE)
                j += 1
        else:
            for j in tl.range(j0, j1, num_stages=STAGES):
                x = _pair_step(x, j, i0 + j - j0, steps, pairs, F, U, final, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk,
                               off_kv, H, K, V, W, WF, PW, PREC, EMULATE)
    else:
        j = j0
        while j < j1:
            x = _pair_table_step(x, j, steps, pairs, F, U, final, ou, s_ot, s_oh, h, rk, rv, tt, ww, off_kk, off_kv,
                                 H, K, V, W, WF, PW, PREC, EMULATE)
            j += 1
    tl.store(final + (r * H + h).to(tl.int64) * K * V + off_kv, x)


# (value block, warps, pipeline stages) tried on a shape's first eager call; the first is the default. H100 run 127
# (scan_bench, the 24-step chain): 264.9, 269.5, 443.9, 593.5, 552.3 us (4 warps spill)
PAIRS_SCAN_CONFIGS = ((32, 8, 3), (32, 8, 2), (32, 4, 2), (16, 4, 2), (16, 4, 3))
PAIRS_SCAN_TUNED: dict = {}


def scan_pairs(init: torch.Tensor, steps: torch.Tensor, cu: torch.Tensor, pairs: torch.Tensor, factors: torch.Tensor,
               U: torch.Tensor, outputs: torch.Tensor, *, max_run: int = 16, bv: int | None = None,
               warps: int | None = None, stages: int | None = None, tune: bool = True,
               precision: str | None = None) -> torch.Tensor:
    """The compose pass's chains with each seam run and the cached map after it taken in one step, made in the scan
    from the run's factors and the map read in place: `pair_lowrank` and `scan_steps(position=True)` in one kernel,
    no pair's dense map written to memory and read back (the compose pass's PAIRS_IN_SCAN, layers/linear.py).

    init [R, H, K, V] fp32; steps [M, 6] int64 (device), the paired step table `scan_steps` takes (a run's row holds
    its byte offset i * H * K * (V + K) * 4 in a pairs' buffer this kernel does not read: its index i; a cached map's,
    the addresses of its own T [H, K, K] and S [H, K, V], fp32 contiguous), STEP_FROM_ZERO and STEP_BY_POSITION flags
    as there; cu [R + 1] int32 (device); pairs [N, >= 4] int64 (device, rows contiguous), `pair_lowrank`'s table:
    run i's row holds the addresses of the cached T_e, S_e after it (16-byte aligned; 0: none); factors
    [N, H, 2 WF + 1, K] and U [N, H, WF, V] fp32 contiguous, the runs' (Kd, W, g) and WY-solved values (reference
    `run_factors`, `run_values`); outputs [N', H, V + K] (bf16 on CUDA: o_t(0) then u_t), each run's tokens' outputs
    corrected in place from the state entering the run (runs of at most max_run tokens). A run's step is

        y = g x + Kd^T (U - W x)   (the run from x: T_r x + S_r),   x <- T_e y + S_e   (or y where no map follows)

    the thin products in `precision` (default "tf32x3" on CUDA, "ieee" in Triton's interpreter), the map's product in
    three tf32 products (`_product3`). Returns final [R, H, K, V]."""
    r, h, k, v = init.shape
    n, _, rows, _ = factors.shape
    wf = (rows - 1) // 2
    pow2 = lambda m: m >= 16 and m & (m - 1) == 0  # noqa: E731
    if not (factors.is_contiguous() and U.is_contiguous() and factors.dtype == U.dtype == torch.float32
            and factors.shape == (n, h, 2 * wf + 1, k) and U.shape == (n, h, wf, v) and pow2(k) and pow2(wf)):
        raise ValueError("factors [N, H, 2 WF + 1, K], U [N, H, WF, V] fp32 contiguous, K and WF powers of two >= 16")
    if pairs.dim() != 2 or pairs.shape[1] < 4 or pairs.stride(1) != 1 or pairs.dtype != torch.int64:
        raise ValueError("pairs must be int64 [N, >= 4] with contiguous rows")
    if (steps.dim() != 2 or steps.shape[1] < 6 or outputs.shape[1:] != (h, v + k) or outputs.stride(-1) != 1
            or outputs.stride(1) != v + k):
        raise ValueError("outputs must be [N, H, V + K] with rows of V + K, and steps need 6 columns")
    init = init.float().contiguous()
    final = torch.empty_like(init)
    prec = precision or ("tf32x3" if init.is_cuda else "ieee")
    bt = max(16, triton.next_power_of_2(max_run))

    def launch(cfg, o=outputs):
        b, w, st = cfg
        COMPILED["pairs_scan"] = _scan_pairs_kernel[(r, h, triton.cdiv(v, b))](
            init, steps, pairs, factors, U, final, cu, o, o.stride(0), o.stride(1), H=h, K=k, V=v, BV=b,
            W=steps.shape[1], BT=bt, WF=wf, PW=pairs.stride(0), PREC=prec, STAGES=st if init.is_cuda else 1,
            EMULATE=not init.is_cuda, num_warps=w)

    fits = [c for c in PAIRS_SCAN_CONFIGS if v % c[0] == 0]
    cfg = fits[0] if fits else (16, 4, 2)
    if bv is not None or warps is not None or stages is not None:
        cfg = (bv or cfg[0], warps or cfg[1], stages or cfg[2])
    elif tune and fits:
        scratch = []            # (the outputs are corrected in place: trials on a copy, as scan_steps')

        def trial(c):
            if scratch:
                scratch[0].copy_(outputs)
            else:
                scratch.append(outputs.clone())
            launch(c, scratch[0])

        cfg = tuned_config(PAIRS_SCAN_TUNED, (r, h, k, v, wf, prec), fits, init.device, trial, final, cfg, 1e-5)
    if v % cfg[0]:
        raise ValueError(f"value blocks of {cfg[0]} must tile V = {v}")
    launch(cfg)
    return final


@triton.jit
def _tail_kernel(o, u, s0, U, F, cu, final, N, s_on, s_oh, s_un, s_uh, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, WF: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, NT: tl.constexpr,
                 PREC: tl.constexpr):
    """Program (value head h, block of BV value columns): the tail's NT runs walked from the chain's state
    x = s0[h][:, block], each run's outputs corrected from the state entering it, then the state through its factors."""
    h = tl.program_id(0)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    rk = tl.arange(0, K)
    rw = tl.arange(0, WF)
    tt = tl.arange(0, BT)
    x = tl.load(s0 + h * (K * V) + rk[:, None] * V + rv[None, :])                              # [K, BV]
    for j in tl.static_range(NT):
        t0 = tl.load(cu + j)
        t1 = tl.load(cu + j + 1)
        rows = (t0 + tt).to(tl.int64)
        mr = rows < t1
        urow = tl.load(u + rows[:, None] * s_un + h * s_uh + rk[None, :], mask=mr[:, None], other=0.0).to(tl.float32)
        optr = o + rows[:, None] * s_on + h * s_oh + rv[None, :]
        orow = tl.load(optr, mask=mr[:, None], other=0.0).to(tl.float32)
        tl.store(optr, (orow + tl.dot(urow, x, input_precision=PREC)).to(o.dtype.element_ty), mask=mr[:, None])
        fb = F + (j * HV + h) * ((2 * WF + 1) * K)
        kd = tl.load(fb + rw[:, None] * K + rk[None, :])                                      # [WF, K]
        wf = tl.load(fb + (WF + rw)[:, None] * K + rk[None, :])                               # [WF, K]
        gamma = tl.load(fb + 2 * WF * K)
        uv = tl.load(U + (j * HV + h) * (WF * V) + rw[:, None] * V + rv[None, :])            # [WF, BV]
        d = uv - tl.dot(wf, x, input_precision=PREC)
        x = gamma * x + tl.dot(tl.trans(kd), d, input_precision=PREC)                         # [K, BV]
    tl.store(final + h * (K * V) + rk[:, None] * V + rv[None, :], x)
    zero = tl.zeros((BT, BV), dtype=o.dtype.element_ty)
    start = tl.load(cu + NT)
    while start < N:                       # the pads' rows after the tail: zero
        prow = (start + tt).to(tl.int64)
        tl.store(o + prow[:, None] * s_on + h * s_oh + rv[None, :], zero, mask=(prow < N)[:, None])
        start += BT


def tail_epilogue(o, u, s0, U, fac, cu, *, block_v: int | None = None, warps: int = 4, precision: str | None = None):
    """ops/reference/gated_delta.gated_delta_tail in one launch (its docstring has the layout): program (value head,
    block of value columns) holds its block of the state from s0 on, and for each of the tail's runs corrects the
    run's outputs in o in place, then takes the state through the run's factors (two thin products); the pads' rows
    zeroed. The rows' strides are read from o and u (views of the summary's [N, HV, V + K] outputs); s0, U and the
    factors contiguous. precision: tl.dot's (default "tf32x3" on CUDA: fp32-level products; "ieee" elsewhere).
    The compose pass's form since H100 runs 109-110 (QUERY_TAIL): 34-35 us a layer at the 35B shape (runs 116-120)."""
    hv, k, v = s0.shape
    nt, wf = U.shape[0], U.shape[-2]
    block_v = block_v or min(32, v)       # (sm_90a, offline: 227 registers, no spills at 32 and 4 warps)
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    if not (s0.is_contiguous() and U.is_contiguous() and fac.is_contiguous() and s0.dtype == torch.float32
            and U.shape == (nt, hv, wf, v) and fac.shape == (nt, hv, 2 * wf + 1, k) and v % block_v == 0
            and cu.shape == (nt + 1,) and o.stride(-1) == u.stride(-1) == 1 and pow2(wf) and pow2(k)
            and pow2(block_v) and nt >= 1):
        raise ValueError("tail_epilogue: s0 [HV, K, V] fp32, U [R, HV, WF, V], factors [R, HV, 2 WF + 1, K] "
                         "contiguous, cu [R + 1], rows with unit column stride, K, WF and the block powers of two "
                         ">= 16, V a multiple of the block")
    final = torch.empty_like(s0)
    prec = precision or ("tf32x3" if s0.is_cuda else "ieee")
    _tail_kernel[(hv, v // block_v)](o, u, s0, U, fac, cu, final, o.shape[0], o.stride(0), o.stride(1), u.stride(0),
                                     u.stride(1), HV=hv, K=k, V=v, WF=wf, BV=block_v, BT=wf, NT=nt, PREC=prec,
                                     num_warps=warps)
    return final
