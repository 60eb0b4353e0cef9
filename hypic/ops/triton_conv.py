"""Triton kernel: the compose pass's short causal conv as one gather-multiply-sum (CUDA only).

Token t's output channel c is act(bias[c] + sum_w src[idx[t, w], c] * weight[c, w]): its W inputs are
rows of a source buffer named by a table (the request's initial window, the cached segments' conv
tails, the active tokens' raw inputs; runtime/compose_graph.py builds it). In PyTorch that is a
gather to [N, W, C], an fp32 copy, a product and a sum: four passes over N x W x C (3.4 ms over 30
layers of the 35B model, H200 run 12); here one program per (token, channel block) reads its W rows
once and writes the activation in the source's dtype. The active tokens' raw inputs may be read where the input
GEMM wrote them (`raw`: no copy into the buffer, 30 launches of ~5.5 us a warm request on the H100, run 121), and
the request's conv window is then written by the last token's program from the rows it read.

Imported lazily (layers/linear.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(src, raw, idx, weight, bias, out, win, last, C, split, raw_stride, W: tl.constexpr, BW: tl.constexpr,
                 BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, RAW: tl.constexpr, WIN: tl.constexpr):
    t = tl.program_id(0)
    cb = tl.program_id(1)
    ch = cb * BC + tl.arange(0, BC)
    w = tl.arange(0, BW)
    mc = ch < C
    mw = w < W
    rows = tl.load(idx + t * W + w, mask=mw, other=0).to(tl.int64)
    at = src + rows[:, None] * C + ch[None, :]
    if RAW:     # rows from `split` on are the active tokens' raw inputs, read in place (strided rows of a GEMM's output)
        at = tl.where((rows >= split)[:, None], raw + (rows - split)[:, None] * raw_stride + ch[None, :], at)
    x = tl.load(at, mask=mw[:, None] & mc[None, :], other=0.0)
    k = tl.load(weight + ch[None, :] * W + w[:, None], mask=mw[:, None] & mc[None, :], other=0.0)
    y = tl.sum(x.to(tl.float32) * k.to(tl.float32), axis=0)
    if HAS_BIAS:
        y += tl.load(bias + ch, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out + t.to(tl.int64) * C + ch, y.to(out.dtype.element_ty), mask=mc)
    if WIN:     # the token `last`: its newest W - 1 inputs are the conv window the request keeps, stored as read
        if t == tl.load(last):
            tl.store(win + (w - 1)[:, None] * C + ch[None, :], x, mask=((w >= 1) & mw)[:, None] & mc[None, :])


def gathered_conv(src: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None, *, raw: torch.Tensor | None = None, window: torch.Tensor | None = None,
                  last: torch.Tensor | None = None) -> torch.Tensor:
    """src [M, C], idx [N, W] int64 rows of src (oldest first), weight [C, W], bias [C] | None ->
    [N, C] in src's dtype; activation None or "silu".
    raw [R, C] (rows may be strided, unit column stride): src's last R rows are read from raw instead (they need not be
    copied there). window [W - 1, C] with last (a one-element int64 device tensor, a token index): the token's newest
    W - 1 inputs (rows idx[last, 1:]) are written to window as they are."""
    n, w = idx.shape
    c = src.shape[1]
    if raw is not None and (raw.shape[1] != c or raw.stride(1) != 1 or raw.dtype != src.dtype or raw.shape[0] > src.shape[0]):
        raise ValueError("raw must be [R <= M, C] rows of src's dtype with unit column stride")
    if window is not None and (last is None or window.shape != (w - 1, c) or not window.is_contiguous()
                               or window.dtype != src.dtype):
        raise ValueError("window must be [W - 1, C] contiguous in src's dtype, with last given")
    out = src.new_empty((n, c))
    bc = 256
    split = src.shape[0] - (raw.shape[0] if raw is not None else 0)
    _conv_kernel[(n, triton.cdiv(c, bc))](src, src if raw is None else raw, idx.contiguous(), weight.contiguous(),
                                          weight if bias is None else bias, out, out if window is None else window,
                                          idx if last is None else last, c, split,
                                          raw.stride(0) if raw is not None else c, W=w,
                                          BW=max(2, triton.next_power_of_2(w)), BC=bc, HAS_BIAS=bias is not None,
                                          SILU=activation == "silu", RAW=raw is not None, WIN=window is not None,
                                          num_warps=4)
    return out
