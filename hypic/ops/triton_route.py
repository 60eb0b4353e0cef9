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
    sort    one program over the n * k choices (n * k <= SORT_MAX): order (the choices sorted by expert,
            stable: key expert * BN + choice, one bitonic sort in registers) and offs (inclusive
            cumulative counts per expert, a histogram and its cumsum): fast.experts_forward's layout.

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SORT_MAX = 4096        # choices one sort program holds (32 per thread at 4 warps)


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
def _sort_kernel(experts, order, offs, NK, E: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr):
    r = tl.arange(0, BN)
    m = r < NK
    e = tl.load(experts + r, mask=m, other=E).to(tl.int32)       # padding: id E, sorted after every choice
    key = tl.sort(e * BN + r, 0)
    tl.store(order + r, (key % BN).to(tl.int64), mask=m)
    counts = tl.histogram(e, BE, mask=m)
    tl.store(offs + tl.arange(0, BE), tl.cumsum(counts, 0).to(tl.int32), mask=tl.arange(0, BE) < E)


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


def sort_by_expert(flat: torch.Tensor, num_experts: int):
    """flat [n*k] expert ids (int, n*k <= SORT_MAX) -> (order [n*k] int64: choices sorted by expert, stable;
    offs [E] int32: inclusive cumulative counts)."""
    nk = flat.numel()
    if nk > SORT_MAX:
        raise ValueError(f"{nk} choices exceed one sort program's {SORT_MAX}")
    order = torch.empty(nk, dtype=torch.int64, device=flat.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    bn = max(16, triton.next_power_of_2(nk))
    _sort_kernel[(1,)](flat.contiguous(), order, offs, nk, E=num_experts, BN=bn,
                       BE=max(16, triton.next_power_of_2(num_experts)), num_warps=4 if bn >= 1024 else 1)
    return order, offs
