"""Triton kernel: the compose pass's keys and values put in position order, cached keys placed on the way (CUDA only).

Before each attention layer's kernel the pass needs its keys and values in position order (the kernel then walks
each query block's visible prefix only), and the cached segments' position-free keys rotated to the positions they
take in this request. As PyTorch ops that is, per layer on the 35B request (~33k keys of 2 heads x 256): the RoPE
products, sums and the copy of the dims RoPE leaves alone (~80 us), then a gather of the keys and one of the values
(~43 us; H200 run 63's profile). Here one launch reads every row once and writes it once:

    program (block of BR ordered rows): for each row i, src = kperm[i];
        values: ov[i] = values[src]
        keys:   a cached row (lo <= src < lo + n): placed = RoPE(free[src - lo], cos, sin[src - lo]), written to
                keys[src] (the request keeps it) and to ok[i]; any other row: ok[i] = keys[src]

The rotation repeats `layers/rope.Rotary.apply_into`'s roundings (each product rounded to the dtype, then the sum,
round to nearest even), and the launch turns off the fusion of multiplies and adds, so compiled on the GPU the
result equals the PyTorch form bit for bit. (Triton's CPU interpreter truncates fp32 -> bf16 casts whatever the
rounding asked for: there bf16 results differ from PyTorch's in the last bit, fp32 ones do not.)
Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_address import from_address


@triton.jit
def _order_kernel(keys, values, kperm, free, cos, sin, ok, ov, M, lo, n_free, cs_stride, etab, n_ent,
                  W: tl.constexpr, WV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                  BW: tl.constexpr, BWV: tl.constexpr, BR: tl.constexpr, PLACE: tl.constexpr,
                  ENTRIES: tl.constexpr = False, LOGE: tl.constexpr = 1, EW: tl.constexpr = 6,
                  ALIGNED: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rmask = rows < M
    src = tl.load(kperm + rows, mask=rmask, other=0).to(tl.int64)
    out_row = rows.to(tl.int64)
    cv = tl.arange(0, BWV)
    vm = rmask[:, None] & (cv < WV)[None, :]
    ck = tl.arange(0, BW)
    col_ok = ck < W
    j = src - lo
    cached = rmask & (j >= 0) & (j < n_free)
    if ENTRIES:
        # the cached rows read in place from their segments' tensors: etab rows (key address, value address, first
        # cached row) per entry, then (-, -, the cached rows' count); a row's entry by a binary search over the
        # first rows (a row past the count, an unused slot of the bucket, is no entry's: read as any other row)
        e_lo = tl.zeros((BR,), dtype=tl.int64)
        e_hi = tl.full((BR,), 0, tl.int64) + n_ent + 1
        for _ in tl.static_range(LOGE):
            mid = (e_lo + e_hi) // 2
            go = e_hi - e_lo > 1
            st = tl.load(etab + mid * EW + 2, mask=cached & go, other=0)
            up = go & (st <= j)
            e_lo = tl.where(up, mid, e_lo)
            e_hi = tl.where(go & ~up, mid, e_hi)
        cached = cached & (e_lo < n_ent)
        off = j - tl.load(etab + e_lo * EW + 2, mask=cached, other=0)
        ka = tl.load(etab + e_lo * EW, mask=cached, other=0)
        va = tl.load(etab + e_lo * EW + 1, mask=cached, other=0)
        if ALIGNED:         # (rows of whole 16-byte groups at 16-byte aligned addresses, layers/attention.py
            # `_fill_entries`: the loads take 16 bytes)
            kbase = from_address(free, ka, cached) + off * W
            vbase = from_address(values, va, cached) + off * WV
        else:
            kbase = ka.to(tl.pointer_type(free.dtype.element_ty)) + off * W
            vbase = va.to(tl.pointer_type(values.dtype.element_ty)) + off * WV
        vrow = tl.load(vbase[:, None] + cv[None, :], mask=vm & cached[:, None], other=0.0)
        vrow = tl.where(cached[:, None], vrow,
                        tl.load(values + src[:, None] * WV + cv[None, :], mask=vm & ~cached[:, None], other=0.0))
    else:
        kbase = free + j * W
        vrow = tl.load(values + src[:, None] * WV + cv[None, :], mask=vm)
    tl.store(ov + out_row[:, None] * WV + cv[None, :], vrow, mask=vm)
    if PLACE:
        d = ck % D
        rot = d < R
        partner = (ck // D) * D + tl.where(d < HALF, d + HALF, d - HALF)
        ci = d % HALF
        cm = cached[:, None] & col_ok[None, :]
        rm = cm & rot[None, :]
        base = kbase[:, None]
        x = tl.load(base + ck[None, :], mask=cm, other=0.0)
        xp = tl.load(base + partner[None, :], mask=rm, other=0.0)
        c = tl.load(cos + j[:, None] * cs_stride + ci[None, :], mask=rm, other=0.0)
        s = tl.load(sin + j[:, None] * cs_stride + ci[None, :], mask=rm, other=0.0)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
        b = (xp.to(tl.float32) * s.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
        sign = tl.where(d < HALF, -1.0, 1.0)
        placed = tl.where(rot[None, :], (a + sign[None, :] * b).to(x.dtype, fp_downcast_rounding="rtne"), x)
        tl.store(keys + src[:, None] * W + ck[None, :], placed, mask=cm)
        other = rmask & ~cached
        km = other[:, None] & col_ok[None, :]
        k_row = tl.where(cached[:, None], placed, tl.load(keys + src[:, None] * W + ck[None, :], mask=km, other=0.0))
    else:
        k_row = tl.load(keys + src[:, None] * W + ck[None, :], mask=rmask[:, None] & col_ok[None, :])
    tl.store(ok + out_row[:, None] * W + ck[None, :], k_row, mask=rmask[:, None] & col_ok[None, :])


# the entries' rows read 16 bytes at a time where `_aligned_rows` allows (thirty-sixth session; off: one element at a
# time, as before. H100 run 118, with the pair kernel's PAIR_ALIGNED (gpu_bench's `loads_by_element`): the ordering
# kernel 0.62 against 0.69 ms, the warm request -0.22 ms for both, paired)
ALIGNED_ENTRIES = True


def _aligned_rows(w: int, wv: int, kbase: torch.Tensor, vbase: torch.Tensor) -> bool:
    """The entries' rows read 16 bytes at a time (`from_address`): rows of whole 16-byte groups, bases the offsets are taken
    from 16-byte aligned (the entries' addresses are: layers/attention.py `_fill_entries`)."""
    return all(n * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for n, t in ((w, kbase), (wv, vbase)))


def order_keys(keys, values, kperm, *, free=None, lo: int = 0, cos=None, sin=None, rotary_dim: int = 0, out=None,
               entries=None):
    """ops/reference/attention.order_keys in one launch (its docstring has the layout). keys, values, free, cos and
    sin contiguous in their rows (the compose pass's buffers are); out: contiguous (ok, ov) to write into.
    entries (layers/attention.py ORDER_FROM_ENTRIES): (table, E), the cached rows read in place from their segments'
    tensors instead of from free and from values' cached rows (neither is read then, nor need they be filled):
    table int64 [>= E + 1, >= 3] (device, rows contiguous), row i < E = (its keys' address, its values' address, its
    first row among the cached rows), row E's third column = the cached rows' count (rows of free past it are slots of
    no entry). The cached values are not written to `values` (the request's state takes them from the entries)."""
    n_keys, hkv, d = keys.shape
    w, wv, m = hkv * d, values.shape[1] * values.shape[2], kperm.shape[0]
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("order_keys: keys and values must be contiguous")
    if m != n_keys or values.shape[0] != n_keys:
        raise ValueError(f"order_keys: kperm must order all {n_keys} rows, got {m} for {values.shape[0]} values")
    if out is None:
        ok = keys.new_empty((m, hkv, d))
        ov = values.new_empty((m,) + tuple(values.shape[1:]))
    else:
        ok, ov = out
        if (ok.shape != keys.shape or ov.shape != values.shape or ok.dtype != keys.dtype or ov.dtype != values.dtype
                or not (ok.is_contiguous() and ov.is_contiguous())):
            raise ValueError("order_keys: out must be contiguous buffers of the keys' and values' shapes and dtypes")
    if m == 0:
        return ok, ov
    place = free is not None and free.shape[0] > 0
    if place:
        if free.shape[1:] != keys.shape[1:] or not free.is_contiguous() or free.dtype != keys.dtype:
            raise ValueError("order_keys: free must be contiguous keys of the buffer's head layout and dtype")
        if rotary_dim % 2 or rotary_dim > d or (rotary_dim and (cos.stride(1) != 1 or sin.stride() != cos.stride())):
            raise ValueError("order_keys: an even rotary_dim <= head dim and row-contiguous cos, sin tables")
    r = rotary_dim if place else 0
    table, n_ent = entries if entries is not None else (kperm, 0)
    if entries is not None and not (place and table.dtype == torch.int64 and table.dim() == 2
                                    and table.shape[0] > n_ent and table.shape[1] >= 3 and table.stride(1) == 1):
        raise ValueError("order_keys: entries need free (its shape) and an int64 table [>= E + 1, >= 3]")
    bw, bwv = triton.next_power_of_2(w), triton.next_power_of_2(wv)
    # ~16 elements of a row block per thread and live tensor (the rotation keeps ~8 of them: x, its partner, cos, sin,
    # two rounded products, the result, the row): 4,096-element blocks over 8 warps
    br = max(1, min(64, 4096 // max(bw, bwv)))
    warps = 8 if br * max(bw, bwv) >= 4096 else 4
    _order_kernel[(triton.cdiv(m, br),)](
        keys, values, kperm, free if place else keys, cos if place and r else keys, sin if place and r else keys,
        ok, ov, m, lo, free.shape[0] if place else 0, cos.stride(0) if place and r else 0, table, n_ent,
        W=w, WV=wv, D=d, R=r, HALF=max(r // 2, 1), BW=bw, BWV=bwv, BR=br, PLACE=place, ENTRIES=entries is not None,
        LOGE=max(1, (n_ent + 1).bit_length()), EW=table.stride(0) if entries is not None else 6,
        ALIGNED=ALIGNED_ENTRIES and entries is not None and _aligned_rows(w, wv, free if place else keys, values),
        num_warps=warps,
        enable_fp_fusion=False)
    return ok, ov
