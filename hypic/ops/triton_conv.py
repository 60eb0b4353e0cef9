"""Triton kernel: the compose pass's short causal conv as one gather-multiply-sum (CUDA only).

Token t's output channel c is act(bias[c] + sum_w src[idx[t, w], c] * weight[c, w]): its W inputs are
rows of a source buffer named by a table (the request's initial window, the cached segments' conv
tails, the active tokens' raw inputs; runtime/compose_graph.py builds it). In PyTorch that is a
gather to [N, W, C], an fp32 copy, a product and a sum: four passes over N x W x C (3.4 ms over 30
layers of the 35B model, H200 run 12); here one program per (token, channel block) reads its W rows
once and writes the activation in the source's dtype.

Imported lazily (layers/linear.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(src, idx, weight, bias, out, C, W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    t = tl.program_id(0)
    cb = tl.program_id(1)
    ch = cb * BC + tl.arange(0, BC)
    w = tl.arange(0, BW)
    mc = ch < C
    mw = w < W
    rows = tl.load(idx + t * W + w, mask=mw, other=0)
    x = tl.load(src + rows.to(tl.int64)[:, None] * C + ch[None, :], mask=mw[:, None] & mc[None, :], other=0.0)
    k = tl.load(weight + ch[None, :] * W + w[:, None], mask=mw[:, None] & mc[None, :], other=0.0)
    y = tl.sum(x.to(tl.float32) * k.to(tl.float32), axis=0)
    if HAS_BIAS:
        y += tl.load(bias + ch, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out + t.to(tl.int64) * C + ch, y.to(out.dtype.element_ty), mask=mc)


def gathered_conv(src: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None) -> torch.Tensor:
    """src [M, C], idx [N, W] int64 rows of src (oldest first), weight [C, W], bias [C] | None ->
    [N, C] in src's dtype; activation None or "silu"."""
    n, w = idx.shape
    c = src.shape[1]
    out = src.new_empty((n, c))
    bc = 256
    _conv_kernel[(n, triton.cdiv(c, bc))](src, idx.contiguous(), weight.contiguous(), weight if bias is None else bias,
                                          out, c, W=w, BW=max(2, triton.next_power_of_2(w)), BC=bc,
                                          HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4)
    return out
