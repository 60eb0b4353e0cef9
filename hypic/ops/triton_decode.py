"""Triton kernel: a decode step's attention, one query per sequence over its own cached keys (CUDA; tests run it in
Triton's interpreter).

The decode buffers hold each sequence's keys and values as [B, Hkv, C, D] with lengths[b] valid slots. The
PyTorch form (ops/fast.py `decode_attention`) scores all C slots of every sequence with two batched GEMMs whose
reduction runs over one sequence at a time: at a 32k context those GEMMs read the keys and values at a fraction of
the copy rate (H200 run 41's decode profile: 45 us per layer for the values' product, 10 layers per step). Here
the split-K (flash-decoding) form:

    program (sequence, kv head, split of the slots): rows are the kv head's group of query heads (padded to the
    16 rows a tensor-core product needs); it walks its split's valid slots in blocks of BN with an online
    softmax (fp32) and writes the unnormalised output with the row maximum and sum; `decode_attention` folds
    the splits (log-sum-exp weights).

Splits past a sequence's length write m = -inf, l = 0 and weigh nothing in the fold. The split count comes from
the shapes (no host sync: CUDA-graph safe).

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_scan import _sm_count


@triton.jit
def _decode_partial(q, k, v, lengths, acc_out, m_out, l_out, s_kb, s_kh, s_kc, s_vb, s_vh, s_vc, per_split, scale,
                    H: tl.constexpr, HKV: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    nsp = tl.num_programs(2)
    n = tl.load(lengths + b).to(tl.int32)
    n0 = sp * per_split
    n1 = tl.minimum(n0 + per_split, n)
    rows = tl.arange(0, BR)
    row_ok = rows < REP
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    qb = tl.load(q + ((b * H + hk * REP + rows).to(tl.int64) * D)[:, None] + d[None, :],
                 mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    kbase = k + b.to(tl.int64) * s_kb + hk.to(tl.int64) * s_kh
    vbase = v + b.to(tl.int64) * s_vb + hk.to(tl.int64) * s_vh
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BDV], tl.float32)
    c0 = n0
    while c0 < n1:
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < n1
        kb = tl.load(kbase + cols.to(tl.int64)[:, None] * s_kc + d[None, :], mask=col_ok[:, None] & (d < D)[None, :],
                     other=0.0)
        s = tl.dot(qb, tl.trans(kb)) * scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vb = tl.load(vbase + cols.to(tl.int64)[:, None] * s_vc + dv[None, :],
                     mask=col_ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
        c0 += BN
    out = ((b * HKV + hk) * nsp + sp).to(tl.int64) * BR + rows
    tl.store(acc_out + out[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(m_out + out, m_i, mask=row_ok)
    tl.store(l_out + out, l_i, mask=row_ok)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                     block_n: int = 64, splits: int | None = None, warps: int = 4) -> torch.Tensor:
    """q [B, H, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv] (any strides with a unit last one; one dtype), lengths [B]
    (device) -> [B, H, Dv] in q's dtype: each query over the first lengths[b] slots of its sequence."""
    b, h, d = q.shape
    hkv, cap, dv = k.shape[1], k.shape[2], v.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("keys and values need a unit stride in their last dimension")
    rep = h // hkv
    q = q.contiguous()
    if splits is None:                 # about two programs per SM, each walking at least four key blocks
        splits = max(1, min(triton.cdiv(2 * _sm_count(q.device), b * hkv), triton.cdiv(cap, 4 * block_n)))
    per = triton.cdiv(triton.cdiv(cap, splits), block_n) * block_n
    splits = triton.cdiv(cap, per)
    br = max(16, triton.next_power_of_2(rep))
    acc = q.new_empty((b, hkv, splits, br, dv), dtype=torch.float32)
    m = q.new_empty((b, hkv, splits, br), dtype=torch.float32)
    l = torch.empty_like(m)
    _decode_partial[(b, hkv, splits)](
        q, k, v, lengths, acc, m, l, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), per,
        scale, H=h, HKV=hkv, REP=rep, D=d, DV=dv, BR=br, BD=max(16, triton.next_power_of_2(d)),
        BDV=max(16, triton.next_power_of_2(dv)), BN=block_n, num_warps=warps)
    acc, m, l = acc[..., :rep, :], m[..., :rep], l[..., :rep]
    w = torch.exp(m - m.amax(2, keepdim=True))                   # splits past the length: m = -inf, w = 0
    out = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]   # [B, Hkv, rep, Dv]
    return out.reshape(b, h, dv).to(q.dtype)
