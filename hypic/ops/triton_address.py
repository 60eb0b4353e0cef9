"""Triton helper: a pointer to a tensor named by its integer address, in a form the compiler can vectorize (CUDA only).

The compose pass's kernels read cached tensors in place through address tables. An address cast to a pointer tells
the compiler nothing of its alignment, so it loads one element at a time (sm_90a, offline: the pair kernel's 177
scalar loads, the ordering kernel's 80 two-byte ones). The same address written as an aligned pointer argument plus
an offset the compiler is told is a multiple of 16 bytes lets it load 16 bytes at a time.

Imported lazily by the kernels' modules: importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def from_address(base, addr, ok):
    """Pointers to the byte addresses `addr` (16-byte aligned: the caller's tables name no other) as base + offsets
    known to be multiples of 16 bytes; base itself where not ok (the loads through it are masked). base: a 16-byte
    aligned pointer argument of the pointed-to type."""
    size: tl.constexpr = base.dtype.element_ty.primitive_bitwidth // 8
    o = tl.where(ok, (addr - base.to(tl.int64)) // size, 0)
    return base + tl.multiple_of(o, 16 // size)
