"""Triton kernel: many memory blocks copied in one launch, named by address (CUDA only).

The compose pass's buffers are filled per request from the cached segments: every attention layer's
keys and values and every linear layer's conv tail, a block per (segment, layer), ~1,000 blocks on the
35B model's 20-segment request. As torch.cat calls that is ~50 launches of ~90 us of host time each
(H200 run 31: the fill took 3.8 ms of host time for 0.4 ms of GPU work, before the graph could start).
Here the host writes one table (source address, destination address, bytes) in numpy and one launch
copies every block:

    program (block row r, lane c): copies 8-byte words c * W, (c + P) * W, ... of row r (W words a step)

Addresses and sizes must be multiples of 16 bytes (the caller checks; rows of bf16 keys or conv inputs
are). The sources must stay alive until the copy has run (stream order: the request holds its entries).
Imported lazily (runtime/compose_graph.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

WORDS = 2048                    # 8-byte words per step of a program (16 KB)
LANES = 32                      # programs per block row


@triton.jit
def _copy_kernel(table, lanes, W: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(table + r * 3).to(tl.pointer_type(tl.int64))
    dst = tl.load(table + r * 3 + 1).to(tl.pointer_type(tl.int64))
    n = tl.load(table + r * 3 + 2) // 8
    src = tl.multiple_of(src, 16)
    dst = tl.multiple_of(dst, 16)
    a = c.to(tl.int64) * W
    while a < n:
        offs = a + tl.arange(0, W)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
        a += lanes * W


def copy_blocks(rows: np.ndarray, device) -> torch.Tensor:
    """rows [N, 3] int64 (source address, destination address, bytes), every value a multiple of 16 -> the
    device table (keep it until the copy has run: the caching allocator does, by stream order)."""
    if rows.shape[0] == 0:
        return None
    if (rows % 16).any():
        raise ValueError("copy_blocks needs addresses and sizes that are multiples of 16 bytes")
    table = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device, non_blocking=True)
    lanes = max(1, min(LANES, -(-int(rows[:, 2].max()) // (8 * WORDS))))
    _copy_kernel[(rows.shape[0], lanes)](table, lanes, W=WORDS, num_warps=4)
    return table
