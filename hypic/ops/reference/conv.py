"""Short causal depthwise convolution with an explicit window, pure PyTorch reference.

Layout:
    x       [B, T, C]      raw conv inputs (channels last)
    weight  [C, W]         one filter of width W per channel
    window  [B, W-1, C]    the W-1 raw inputs that precede x (zeros at a sequence start)
Output y_t = act(sum_j weight[:, j] * xx[t + j]) over xx = cat(window, x); the new window is the
last W-1 rows of xx, so runs shorter than W-1 keep part of the old window (short segments chain).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x, weight, bias=None, *, window=None, activation: str | None = "silu"):
    """Returns (y [B, T, C] in x's dtype, new_window [B, W-1, C])."""
    b, t, c = x.shape
    w = weight.shape[-1]
    if window is None:
        window = x.new_zeros(b, w - 1, c)
    xx = torch.cat([window.to(x.dtype), x], dim=1)                       # [B, W-1+T, C]
    y = F.conv1d(xx.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, groups=c)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    # the new window owns its memory: it is kept in request states and prefix-cache nodes, where a
    # view would pin the whole run's inputs while the byte accounting counts only W-1 rows
    return y.transpose(1, 2).to(x.dtype), xx[:, xx.shape[1] - (w - 1):].clone()


def causal_conv1d_varlen(x, weight, bias, windows, cu_seqlens, *, activation: str | None = "silu"):
    """The runs of a varlen batch one at a time: x [n, C] back to back, windows [R, W-1, C], cu_seqlens
    [R + 1]. Returns (y [n, C], new_windows [R, W-1, C])."""
    cu = cu_seqlens.tolist()
    ys, new = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        y, w = causal_conv1d(x[None, a:b], weight, bias, window=windows[i : i + 1], activation=activation)
        ys.append(y[0])
        new.append(w[0])
    return torch.cat(ys, dim=0), torch.stack(new)
