"""Triton kernels: an MoE layer's routing and its sort by expert, one launch each (CUDA; tests run them
in Triton's interpreter).

On the warm pic request and in decode the routed experts see few rows, and what surrounds the expert
kernels was a dozen small launches per layer (softmax, top-k, sum, divide, cast; a cast of the ids, a
radix sort, zeros, ones, scatter-add, cumsum), ~500 of the 35B request's ~3,100 kernels. Here:

    route   program per token: softmax of the E router logits in fp32, the top k by k rounds of argmax
            (equal probabilities: the lowest expert id first), optionally renormalised to sum to one,
            weights rounded once to the logits' dtype. ops/reference/moe.py `route` is the reference;
            torch.topk breaks ties its own way, so where probabilities are exactly equal at the k-th
            place the two may keep different (equally valid) experts.
    sort    order (the choices sorted by expert, stable) and offs (inclusive cumulative counts per expert):
            fast.experts_forward's layout, n * k <= SORT_MAX. A counting sort by ranks: choice i goes to
            #{j: e_j < e_i} + #{j < i: e_j == e_i}, the number of keys (e_j, j) below its own, which a
            program per block of choices counts against all of them ([BI x BJ] comparisons at a time);
            one more program makes the histogram and its cumsum. (H200 run 38: the one-program bitonic
            sort it replaces took 41 us per layer for 224 x 8 choices, 1.6 ms of the warm pic request; run 63:
            11.9 us.) The default since (PREFIX_RANK) takes the same ranks from histograms, O(NK) per program:
            the choices of lower experts and of the same expert before the block from two histograms, the
            same expert earlier in the block by [BI x BI] comparisons.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fast import SORT_MAX   # the choices one sort takes (its comparisons grow as their square)

# the ranks from histograms (O(NK) a program) where True; False: by comparing every pair of choices (O(BI NK) a
# program; H200 run 63: 11.9 us a layer for 224 x 8 choices), gpu_bench's variant `sort_by_comparisons`
PREFIX_RANK = True


@triton.jit
def _route_kernel(logits, weights, experts, s_l, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr,
                  BK: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    re = tl.arange(0, BE)
    me = re < E
    z = tl.load(logits + t * s_l + re, mask=me, other=float("-inf")).to(tl.float32)
    z = tl.exp(z - tl.max(z, 0))
    p = z / tl.sum(z, 0)
    rk = tl.arange(0, BK)
    w = tl.zeros([BK], dtype=tl.float32)
    ids = tl.zeros([BK], dtype=tl.int32)
    cur = tl.where(me, p, -1.0)                     # probabilities are >= 0: padding never wins
    for j in tl.static_range(K):
        best = tl.argmax(cur, 0, tie_break_left=True)
        w = tl.where(rk == j, tl.max(cur, 0), w)
        ids = tl.where(rk == j, best, ids)
        cur = tl.where(re == best, -2.0, cur)
    mk = rk < K
    if NORM:
        w = w / tl.sum(tl.where(mk, w, 0.0), 0)
    tl.store(weights + t * K + rk, w.to(weights.dtype.element_ty), mask=mk)
    tl.store(experts + t * K + rk, ids.to(tl.int64), mask=mk)


@triton.jit
def _real_choices(real, NK, K: tl.constexpr, REAL: tl.constexpr):
    """The number of choices that are real tokens': REAL, real[0] rows of K choices each (the rest padding's), else
    all NK."""
    if REAL:
        nr = tl.minimum(tl.load(real).to(tl.int32) * K, NK)
    else:
        nr = NK
    return nr


@triton.jit
def _rank_kernel(experts, order, offs, NK, real, E: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
                 BN: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, REAL: tl.constexpr):
    p = tl.program_id(0)
    nr = _real_choices(real, NK, K, REAL)
    if p * BI < NK:                               # a block of choices: each one's rank among all keys (e, index)
        ri = p * BI + tl.arange(0, BI)
        mi = ri < NK
        ei = tl.load(experts + ri, mask=mi & (ri < nr), other=E).to(tl.int32)   # padding's: id E, after every expert
        rank = tl.zeros([BI], dtype=tl.int32)
        j0 = 0
        while j0 < NK:                            # (a while loop: Triton's interpreter cannot range over NK)
            rj = j0 + tl.arange(0, BJ)
            ej = tl.load(experts + rj, mask=rj < nr, other=E).to(tl.int32)     # padding: id E, above every choice
            below = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (rj[None, :] < ri[:, None]))
            rank += tl.sum(below.to(tl.int32), 1)
            j0 += BJ
        tl.store(order + rank, ri.to(tl.int64), mask=mi)
    else:                                         # the last program: the inclusive cumulative counts
        counts = tl.zeros([BE], dtype=tl.int32)
        n0 = 0
        while n0 < NK:
            r = n0 + tl.arange(0, BN)
            m = r < nr
            e = tl.load(experts + r, mask=m, other=0).to(tl.int32)
            counts += tl.histogram(e, BE, mask=m).to(tl.int32)
            n0 += BN
        tl.store(offs + tl.arange(0, BE), tl.cumsum(counts, 0).to(tl.int32), mask=tl.arange(0, BE) < E)


@triton.jit
def _prefix_rank_kernel(experts, order, offs, NK, real, E: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr,
                        BE: tl.constexpr, K: tl.constexpr, REAL: tl.constexpr):
    """The same ranks from histograms: program p (choices i0 .. i0 + BI - 1) counts every expert over all choices
    and over those before i0, so choice i's rank is (choices of a lower expert) + (same expert, before the block)
    + (same expert, earlier in the block, by a [BI x BI] comparison); program 0 also writes the cumulative counts.
    Padding's choices (REAL: the last ones, from nr on) are counted nowhere and keep their own index as their rank:
    every real choice ranks below nr, so together they are a permutation."""
    p = tl.program_id(0)
    i0 = p * BI
    nr = _real_choices(real, NK, K, REAL)
    bins = tl.arange(0, BE)
    total = tl.zeros([BE], dtype=tl.int32)
    before = tl.zeros([BE], dtype=tl.int32)
    n0 = 0
    while n0 < NK:                                # (a while loop: Triton's interpreter cannot range over NK)
        r = n0 + tl.arange(0, BN)
        m = r < nr
        e = tl.load(experts + r, mask=m, other=0).to(tl.int32)
        total += tl.histogram(e, BE, mask=m).to(tl.int32)
        before += tl.histogram(e, BE, mask=m & (r < i0)).to(tl.int32)
        n0 += BN
    upto = tl.cumsum(total, 0)
    base = upto - total + before                  # per expert: lower experts' choices + its own before the block
    ri = i0 + tl.arange(0, BI)
    mi = ri < NK
    ei = tl.load(experts + ri, mask=mi, other=0).to(tl.int32)
    # (a real choice's earlier choices in the block are all real: padding's come after every real one)
    within = tl.sum(((ei[None, :] == ei[:, None]) & (ri[None, :] < ri[:, None])).to(tl.int32), 1)
    rank = tl.sum(tl.where(bins[None, :] == ei[:, None], base[None, :], 0), 1) + within
    rank = tl.where(ri < nr, rank, ri)
    tl.store(order + rank, ri.to(tl.int64), mask=mi)
    if p == 0:
        tl.store(offs + bins, upto, mask=bins < E)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """logits [N, E] (the router's output) -> (weights [N, k] in logits' dtype, experts [N, k] int64)."""
    n, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = logits.new_empty((n, top_k))
    experts = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, weights, experts, logits.stride(0), E=e, BE=triton.next_power_of_2(e),
                            K=top_k, BK=triton.next_power_of_2(top_k), NORM=norm_topk_prob,
                            num_warps=4 if e > 128 else 1)
    return weights, experts


def sort_by_expert(flat: torch.Tensor, num_experts: int, top_k: int = 1, real: torch.Tensor | None = None):
    """flat [n*k] expert ids (int, n*k <= SORT_MAX) -> (order [n*k] int64: choices sorted by expert, stable;
    offs [E] int32: inclusive cumulative counts). real ([1] int tensor on flat's device, or None): the tokens from
    real[0] on (top_k choices each) are padding: their choices sort last in their own order, and offs leaves them out,
    so no expert's rows hold them."""
    nk = flat.numel()
    if nk > SORT_MAX:
        raise ValueError(f"{nk} choices exceed the rank sort's {SORT_MAX}")
    order = torch.empty(nk, dtype=torch.int64, device=flat.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    be = max(16, triton.next_power_of_2(num_experts))
    if nk == 0:
        offs.zero_()
    elif PREFIX_RANK:
        bi = 64
        # (8 warps: the block's [BI x BE] expert match is 64 values a thread)
        _prefix_rank_kernel[(triton.cdiv(nk, bi),)](flat.contiguous(), order, offs, nk, flat if real is None else real,
                                                   E=num_experts, BI=bi, BN=1024, BE=be, K=top_k,
                                                   REAL=real is not None, num_warps=8)
    else:
        bi, bj = 64, 256
        _rank_kernel[(triton.cdiv(nk, bi) + 1,)](flat.contiguous(), order, offs, nk, flat if real is None else real,
                                                 E=num_experts, BI=bi, BJ=bj, BN=1024, BE=be, K=top_k,
                                                 REAL=real is not None, num_warps=4)
    return order, offs
