"""Triton kernel: few queries at arbitrary positions over many keys, causal by position (CUDA only).

The compose pass's attention: a few hundred active tokens (seam windows, the query) against every
key of a long request (cached segments placed at new positions, the request's own tokens), query i
seeing key j iff k_pos[j] <= q_pos[i]. Flash kernels parallelise over query blocks and heads, too few
here to fill the GPU; the explicit form materialises [heads, queries, keys] scores and walks them
three times. This is the split-K (flash-decoding) form with a position mask:

    program (query block, kv head, key split): rows are (query, head-in-group) pairs, query-major,
    so one block holds BM / rep neighbouring queries of all the group's heads; it walks its split
    of the keys in blocks of BN with an online softmax (fp32), skipping key blocks no row may see
    (their smallest mask position above the block's largest query position), and writes its
    unnormalised output with the row maximum and sum;
    `position_attention` folds the splits (log-sum-exp weights) in a few batched ops.

Every row sees at least one key (the compose pass's pads sit at position 0, where the request has a
key; real queries see themselves), so the fold never divides by zero.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_scan import _sm_count
from .tuning import descriptors_fit


@triton.jit
def _block(qb, qp, m_i, l_i, acc, k, v, kpos, cols, n1, hk, scale, d, dv, HKV: tl.constexpr, D: tl.constexpr,
           DV: tl.constexpr):
    """One block of keys into the online softmax of the rows: (m, l, acc) updated."""
    col_ok = cols < n1
    kp = tl.load(kpos + cols, mask=col_ok, other=0)
    kr = cols.to(tl.int64)
    kb = tl.load(k + (kr * HKV + hk)[:, None] * D + d[None, :], mask=col_ok[:, None] & (d < D)[None, :],
                 other=0.0)
    s = tl.dot(qb, tl.trans(kb)) * scale
    s = tl.where(col_ok[None, :] & (kp[None, :] <= qp[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vb = tl.load(v + (kr * HKV + hk)[:, None] * DV + dv[None, :], mask=col_ok[:, None] & (dv < DV)[None, :],
                 other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
    return m_new, l_i, acc


@triton.jit
def _block_full(qb, m_i, l_i, acc, k, v, cols, hk, scale, d, dv, HKV: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, BD: tl.constexpr, EVEN_V: tl.constexpr, kd, vd, n, vcol, TMA: tl.constexpr):
    """A block of keys every row of the program may see (FULL_FAST): no position mask, no position loads, and no
    bounds mask on the loads where the blocks cover the head dims exactly (BD == D; EVEN_V: the value splits' blocks
    tile Dv). TMA: the key and value tiles by the tensor descriptors kd, vd of [keys, Hkv * D] and [keys, Hkv * Dv]
    (the block's first key n, its value columns from vcol; BD == D and EVEN_V)."""
    kr = cols.to(tl.int64)
    if TMA:
        kb = kd.load([n, hk * D])
    elif BD == D:
        kb = tl.load(k + (kr * HKV + hk)[:, None] * D + d[None, :])
    else:
        kb = tl.load(k + (kr * HKV + hk)[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    s = tl.dot(qb, tl.trans(kb)) * scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if TMA:
        vb = vd.load([n, vcol])
    elif EVEN_V:
        vb = tl.load(v + (kr * HKV + hk)[:, None] * DV + dv[None, :])
    else:
        vb = tl.load(v + (kr * HKV + hk)[:, None] * DV + dv[None, :], mask=(dv < DV)[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
    return m_new, l_i, acc


@triton.jit
def _first_above(kpos, n, pos):
    """Sorted key positions: the first index in [0, n) whose position is above pos (n if none)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(kpos + mid) <= pos:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _partial_kernel(q, k, v, qpos, kpos, acc_out, m_out, l_out, Nq, Nk, per_split, blocks, n_splits, scale,
                    H: tl.constexpr, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    SORTED: tl.constexpr, STAGES: tl.constexpr, FULL_FAST: tl.constexpr, BALANCE: tl.constexpr,
                    VSPLIT: tl.constexpr, SKIP_EMPTY: tl.constexpr, kd, vd, TMA: tl.constexpr):
    pid_m = tl.program_id(0) // VSPLIT
    vh = tl.program_id(0) % VSPLIT                     # which BDV columns of the values this program sums
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)                 # folded rows: query * REP + head in group
    qi = rows // REP
    head = hk * REP + rows % REP
    row_ok = qi < Nq
    qp = tl.load(qpos + qi, mask=row_ok, other=-1)
    qmax = tl.max(qp, axis=0)
    d = tl.arange(0, BD)
    dv = vh * BDV + tl.arange(0, BDV)
    qb = tl.load(q + (qi.to(tl.int64) * H + head)[:, None] * D + d[None, :], mask=row_ok[:, None] & (d < D)[None, :],
                 other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    n0 = sp * per_split
    n1 = tl.minimum(n0 + per_split, Nk)
    if SORTED:
        # key positions non-decreasing: the rows see a prefix of the keys; its end by binary search, and
        # the split walks only its part of that prefix (nothing past it is loaded)
        if BALANCE:                                      # the prefix in n_splits equal parts, whatever its length
            seen = _first_above(kpos, Nk, qmax)
            per = tl.cdiv(tl.cdiv(seen, n_splits), BN) * BN
            n0 = sp * per
            n1 = tl.minimum(n0 + per, seen)
        else:                                            # fixed ranges: the prefix's end searched in this one only
            n1 = n0 + _first_above(kpos + n0, tl.maximum(n1 - n0, 0), qmax)
        nf = n0                                          # [n0, nf): whole blocks every row sees
        if FULL_FAST:
            qmin = tl.min(tl.where(row_ok, qp, qmax), axis=0)
            every = n0 + _first_above(kpos + n0, tl.maximum(n1 - n0, 0), qmin)
            nf = n0 + tl.maximum(tl.minimum(n1, every) - n0, 0) // BN * BN
        if STAGES > 1:                                   # pipelined loops (the interpreter cannot range over them)
            for it in tl.range(0, (nf - n0) // BN, num_stages=STAGES):
                m_i, l_i, acc = _block_full(qb, m_i, l_i, acc, k, v, n0 + it * BN + tl.arange(0, BN), hk, scale, d,
                                            dv, HKV, D, DV, BD, BDV * VSPLIT == DV, kd, vd, n0 + it * BN,
                                            hk * DV + vh * BDV, TMA)
            for it in tl.range(0, tl.cdiv(n1 - nf, BN), num_stages=STAGES):
                m_i, l_i, acc = _block(qb, qp, m_i, l_i, acc, k, v, kpos, nf + it * BN + tl.arange(0, BN), n1,
                                       hk, scale, d, dv, HKV, D, DV)
        else:
            n = n0
            while n < nf:
                m_i, l_i, acc = _block_full(qb, m_i, l_i, acc, k, v, n + tl.arange(0, BN), hk, scale, d, dv, HKV, D,
                                            DV, BD, BDV * VSPLIT == DV, kd, vd, n, hk * DV + vh * BDV, TMA)
                n += BN
            while n < n1:
                m_i, l_i, acc = _block(qb, qp, m_i, l_i, acc, k, v, kpos, n + tl.arange(0, BN), n1, hk, scale, d,
                                       dv, HKV, D, DV)
                n += BN
    else:
        # keys in any order: every block of the split, those no row may see skipped
        it = 0
        while it < blocks:                               # blocks = per_split / BN
            cols = n0 + it * BN + tl.arange(0, BN)
            kp = tl.load(kpos + cols, mask=cols < n1, other=qmax + 1)
            if tl.min(kp, axis=0) <= qmax:
                m_i, l_i, acc = _block(qb, qp, m_i, l_i, acc, k, v, kpos, cols, n1, hk, scale, d, dv, HKV, D, DV)
            it += 1
    nrows = Nq * REP
    base = (sp * HKV + hk).to(tl.int64) * nrows
    out_rows = base + rows
    wrote = row_ok
    if SKIP_EMPTY:              # a program that saw no key writes its m = -inf and l = 0 alone (the fold skips its acc)
        wrote = row_ok & (n1 > n0)
    tl.store(acc_out + out_rows[:, None] * DV + dv[None, :], acc, mask=wrote[:, None] & (dv < DV)[None, :])
    tl.store(m_out + out_rows, m_i, mask=row_ok & (vh == 0))
    tl.store(l_out + out_rows, l_i, mask=row_ok & (vh == 0))


@triton.jit
def _fold_max(m, s, hk, rows, ok, mx, nrows, HKV: tl.constexpr):
    """The running maximum of the rows' log-sum-exp offsets with split s's."""
    return tl.maximum(mx, tl.load(m + (s * HKV + hk).to(tl.int64) * nrows + rows, mask=ok, other=float("-inf")))


@triton.jit
def _fold_split(acc, m, l, s, hk, rows, dv, ok, mo, mx, den, o, nrows, HKV: tl.constexpr, DV: tl.constexpr):
    """Split s's partials added to the fold's sums (weights exp(m - mx); a split that saw nothing: m = -inf, 0)."""
    at = (s * HKV + hk).to(tl.int64) * nrows + rows
    w = tl.exp(tl.load(m + at, mask=ok, other=float("-inf")) - mx)
    den += w * tl.load(l + at, mask=ok, other=0.0)
    # (a split no key of which a row saw has w = 0 and its acc unwritten (SKIP_EMPTY): not loaded; nor one whose weight
    # is 0 in fp32, which adds nothing)
    o += w[:, None] * tl.load(acc + at[:, None] * DV + dv[None, :], mask=mo & (w > 0.0)[:, None], other=0.0)
    return den, o


@triton.jit
def _fold_kernel(acc, m, l, out, nrows, n_splits, H: tl.constexpr, HKV: tl.constexpr, REP: tl.constexpr,
                 DV: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr, SPLITS: tl.constexpr):
    """The splits' partial outputs folded (log-sum-exp weights) and written as [Nq, H, Dv] in out's dtype: program
    (row block, kv head, value block). SPLITS > 0: the split count rounded up to a multiple of `FOLD_BUCKET` as a
    compile-time constant, the splits past n_splits masked (39th session: the loops unrolled, so the splits' loads need
    not wait on each other); 0: a run-time loop over n_splits (the form before, kept for many splits: `FOLD_UNROLL`)."""
    hk = tl.program_id(1)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    dv = tl.program_id(2) * BDV + tl.arange(0, BDV)
    ok = rows < nrows
    mo = ok[:, None] & (dv < DV)[None, :]
    mx = tl.full([BR], float("-inf"), tl.float32)
    den = tl.zeros([BR], tl.float32)
    o = tl.zeros([BR, BDV], tl.float32)
    if SPLITS > 0:                          # (SPLITS >= n_splits: the splits past n_splits masked off)
        for s in tl.static_range(SPLITS):
            mx = _fold_max(m, s, hk, rows, ok & (s < n_splits), mx, nrows, HKV)
        mx = tl.where(mx == float("-inf"), 0.0, mx)         # (a row no split saw: no row of the compose pass)
        for s in tl.static_range(SPLITS):
            live = s < n_splits
            den, o = _fold_split(acc, m, l, s, hk, rows, dv, ok & live, mo & live, mx, den, o, nrows, HKV, DV)
    else:                   # (while loops: Triton's interpreter cannot range over an argument)
        s = 0
        while s < n_splits:
            mx = _fold_max(m, s, hk, rows, ok, mx, nrows, HKV)
            s += 1
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        s = 0
        while s < n_splits:
            den, o = _fold_split(acc, m, l, s, hk, rows, dv, ok, mo, mx, den, o, nrows, HKV, DV)
            s += 1
    o = o / tl.where(ok, den, 1.0)[:, None]
    qi = rows // REP
    head = hk * REP + rows % REP
    tl.store(out + (qi.to(tl.int64) * H + head)[:, None] * DV + dv[None, :], o.to(out.dtype.element_ty), mask=mo)


# The compose attention's forms (twenty-ninth session), timed side by side by gpu_bench's variants and attention_bench:
# FULL_FAST, key blocks every row of a program sees walked without the position mask; FUSED_FOLD, the splits folded
# by one kernel instead of ~6 PyTorch ops over the [splits, Hkv, rows, Dv] fp32 partials; BALANCE, each row block's
# visible prefix cut into the splits evenly (fixed key ranges left most programs of a seam row block, whose prefix is
# short, nothing to do, and the query's row blocks walking whole ranges); VSPLIT, the value columns over that many
# programs (smaller accumulators, the scores computed in each). H100 (twenty-ninth session, attention_bench at the
# 35B warm request's shape): 564 us before, 497 with FULL_FAST and FUSED_FOLD, 420 with BALANCE too; VSPLIT 2 638
# (off). In the warm request (gpu_bench, paired): the first two -0.86 ms, BALANCE another -0.49 ms.
FULL_FAST = True
FUSED_FOLD = True
BALANCE = True
VSPLIT = 1
# the key splits' rule: about this many programs per SM (at most one resident at a time: 197 KB of shared memory at
# the default launch). attention_bench at the warm request's shape: 16 splits (~4 programs per SM) -5% against 9 (~2,
# the rule before the 39th session) on the H200 (run 56: 540.8 against 568.9 us) and on the H100 (run 124: 353.9
# against 373.5); 8 and 32 slower. In the warm request (H100 run 126, paired): -0.09 ms, partials -212 us and the
# fold +142 us over 10 layers (the fold's split loop then a run-time one). gpu_bench's variant `attention_splits_2`
PROGRAMS_PER_SM = 4
# the fold's loops unrolled up to this many splits (a compile-time split count), a run-time loop above. A call with
# few rows (the last layer's logits row alone: one row block) takes ~128 splits, and the fold unrolled 128 times took
# minutes to build for sm_90a (64 splits: 19 s, 255 registers and spills; 33: 200 registers), which stalled H100 runs
# 127-128 in their first compose pass (fortieth session)
FOLD_UNROLL = 32
# the unrolled fold's compile-time split count: the call's count rounded up to a multiple of this, the rest masked, so
# that a server meeting every count up to FOLD_UNROLL builds the fold FOLD_UNROLL / FOLD_BUCKET times, not once per
# count (0.3-2 s each for sm_90a on the CPU of this project's machines; forty-first session)
FOLD_BUCKET = 8
# (fixed key ranges of ~1,024 or 512 keys, unbalanced, as many splits as ranges, with the row blocks the grid's fastest
# axis so that the programs reading a range run side by side and share it in L2, was measured and removed: H100 run
# 133, attention_bench 394 and 479 us against the default's 354, paired on the warm request +0.37 and +1.19 ms;
# code at git cbbacab. What it left: a program whose keys no row sees writes m and l alone (SKIP_EMPTY; the fold
# does not read its partial sums), and an unbalanced split searches the prefix's end in its own range.)
# the unmasked key blocks' (FULL_FAST) key and value tiles read by tensor descriptors (TMA bulk copies on sm_90+, the
# tile's addresses not computed by the threads) where the tiles cover the head dims; False: by pointers (42nd
# session). H100: attention_bench 380 against 354 us (run 133), in the warm request -0.06 and -0.09 ms paired (runs
# 133, 134; the partials -155 us in run 133's profile), within the rounds' spread: off (gpu_bench variant
# attention_tma)
TMA_KV = False


def _fold_splits(splits: int) -> int:
    """The fold's compile-time split count for a call of `splits`: rounded up to a multiple of FOLD_BUCKET, or 0 (a
    run-time loop) past FOLD_UNROLL."""
    return -(-splits // FOLD_BUCKET) * FOLD_BUCKET if splits <= FOLD_UNROLL else 0


def position_attention(q, k, v, q_pos, k_pos, *, scale: float, sorted_keys: bool = False,
                       block_m: int | None = None, block_n: int = 64, splits: int | None = None, warps: int | None = None,
                       stages: int | None = None, same_width: bool | None = None, full_fast: bool | None = None,
                       fused_fold: bool | None = None, balance: bool | None = None, vsplit: int | None = None,
                       tma: bool | None = None):
    """q [Nq, H, D], k [Nk, Hkv, D], v [Nk, Hkv, Dv] (one dtype), q_pos [Nq], k_pos [Nk] int64 ->
    [Nq, H, Dv] in q's dtype. sorted_keys: k_pos is non-decreasing (each row block walks
    only the prefix of keys it may see, in a pipelined loop). No host sync (CUDA-graph safe): the split count comes from
    the shapes. Block sizes, warps, stages: the fastest of gpu_check's run-13 timings (256 queries x 33k
    keys, head dim 256, H200) unless given; stages 1 under Triton's interpreter.
    full_fast, fused_fold, balance, vsplit, tma (None: the module's FULL_FAST, FUSED_FOLD, BALANCE, VSPLIT, TMA_KV): the
    forms named there; full_fast and balance act on sorted keys only, tma with full_fast where the tiles cover the
    head dims and `tuning.descriptors_fit`.
    Key and value head dims that differ (MLA: Kimi-Linear's 24 / 16) made the compiled kernel fault at their own block
    widths (H200, twenty-eighth session; right in the interpreter); at one block width for both, the larger, it runs
    (H100, twenty-ninth session: 24 / 16, 32 / 16, 16 / 32, benchmarks/attn_probe.py --same-width). same_width (None:
    where the dims differ) picks that."""
    interp = not q.is_cuda
    block_m = block_m or (16 if interp else 128)
    warps = warps or 8
    stages = stages or (1 if interp else 2)
    full_fast = FULL_FAST if full_fast is None else full_fast
    fused_fold = FUSED_FOLD if fused_fold is None else fused_fold
    balance = (BALANCE if balance is None else balance) and sorted_keys
    vsplit = VSPLIT if vsplit is None else vsplit
    nq, h, d = q.shape
    nk, (hkv, dv) = k_pos.shape[0], v.shape[1:]
    rep = h // hkv
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    nrows = nq * rep
    mblocks = triton.cdiv(nrows, block_m)
    if splits is None:                 # about PROGRAMS_PER_SM programs per SM, each walking at least four key blocks
        splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * _sm_count(q.device), mblocks * hkv * vsplit),
                            triton.cdiv(nk, 4 * block_n)))
    per = triton.cdiv(triton.cdiv(nk, splits), block_n) * block_n
    if not balance:                    # (balanced, each program cuts its row block's prefix in `splits` itself)
        splits = triton.cdiv(nk, per)
    acc = q.new_empty((splits, hkv, nrows, dv), dtype=torch.float32)
    m = q.new_empty((splits, hkv, nrows), dtype=torch.float32)
    l = torch.empty_like(m)
    bd = max(16, triton.next_power_of_2(d))
    bdv = max(16, triton.next_power_of_2(triton.cdiv(dv, vsplit)))
    same = d != dv if same_width is None else same_width
    if same:
        bd = bdv = max(bd, bdv)
    kd = vd = None
    # (tiles that cover the head dims exactly: a wider one would read the next head's columns, which the pointer form
    # masks; the views' rows are a key's heads)
    if (TMA_KV if tma is None else tma) and sorted_keys and full_fast and bd == d and bdv * vsplit == dv:
        k2, v2 = k.view(k.shape[0], hkv * d), v.view(v.shape[0], hkv * dv)
        if descriptors_fit(k2, v2):
            from triton.tools.tensor_descriptor import TensorDescriptor

            kd = TensorDescriptor.from_tensor(k2, [block_n, bd])
            vd = TensorDescriptor.from_tensor(v2, [block_n, bdv])
    _partial_kernel[(mblocks * vsplit, hkv, splits)](
        q, k, v, q_pos, k_pos, acc, m, l, nq, nk, per, per // block_n, splits, scale, H=h, HKV=hkv, REP=rep, D=d,
        DV=dv, BD=bd, BDV=bdv, BM=block_m, BN=block_n,
        SORTED=sorted_keys, STAGES=stages if sorted_keys else 1, FULL_FAST=full_fast and sorted_keys,
        BALANCE=balance, VSPLIT=vsplit, SKIP_EMPTY=fused_fold, kd=kd, vd=vd, TMA=kd is not None, num_warps=warps,
        num_stages=stages)
    if fused_fold:
        out = q.new_empty((nq, h, dv))
        br, bf = 16, min(128, max(16, triton.next_power_of_2(dv)))
        _fold_kernel[(triton.cdiv(nrows, br), hkv, triton.cdiv(dv, bf))](
            acc, m, l, out, nrows, splits, H=h, HKV=hkv, REP=rep, DV=dv, BR=br, BDV=bf,
            SPLITS=_fold_splits(splits), num_warps=4)
        return out
    w = torch.exp(m - m.amax(0, keepdim=True))                   # splits a row cannot see: m = -inf, w = 0
    out = (acc * w[..., None]).sum(0) / (l * w).sum(0)[..., None]   # [Hkv, Nq * rep, Dv]
    return out.view(hkv, nq, rep, dv).permute(1, 0, 2, 3).reshape(nq, h, dv).to(q.dtype)
