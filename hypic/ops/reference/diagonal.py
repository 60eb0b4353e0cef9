"""Elementwise (diagonal) linear recurrence, pure PyTorch reference: RecurrentGemma's RG-LRU scan.

Layout (fla's HGRN convention):
    x      [B, T, D]     the input already gated and normalised (u_t)
    g      [B, T, D]     log decay per channel (<= 0)
    state  [N, D]        fp32; varlen: B = 1 and cu_seqlens [N + 1]
Recurrence per channel:
    h_t = exp(g_t) * h_{t-1} + x_t        o_t = h_t
so a segment's transition T is diagonal: exp(sum_t g_t) per channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gated_delta import _pad_varlen, _unpad


def recurrent_diagonal_scan(x, g, *, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Token-by-token reference. Returns (o [B, T, D] in x's dtype, final_state [N, D] fp32 or None)."""
    dtype = x.dtype
    if cu_seqlens is not None:
        (x, g), lens = _pad_varlen((x, g), cu_seqlens)
    x, g = x.float(), g.float()
    b, t, d = x.shape
    h = x.new_zeros(b, d) if initial_state is None else initial_state.float().clone()
    o = torch.empty_like(x)
    for i in range(t):
        h = g[:, i].exp() * h + x[:, i]
        o[:, i] = h
    if cu_seqlens is not None:
        o = _unpad(o, lens)
    return o.to(dtype), (h if output_final_state else None)


def chunk_diagonal_scan(x, g, *, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=16):
    """Chunked form of the same recurrence. Within a chunk, with G_t the cumulative log decay from its start:
        o_t = exp(G_t) h_0 + sum_{s<=t} exp(G_t - G_s) x_s
    Pairwise decays are formed as exp(G_t - G_s) (never exp(-G_s) alone), so strong decays cannot overflow; they
    are a [C, C, D] tensor per chunk. The cumulative sums are fp64 (this form serves the CPU; CUDA runs fla's
    kernel)."""
    dtype = x.dtype
    if cu_seqlens is not None:
        (x, g), lens = _pad_varlen((x, g), cu_seqlens)
    x, g = x.float(), g.float()
    b, t, d = x.shape
    c = chunk_size
    pad = (-t) % c
    x, g = (F.pad(y, (0, 0, 0, pad)).reshape(b, -1, c, d) for y in (x, g))
    # the cumulative sums in fp64: G_t - G_s of two large sums (strong decays) would lose the small difference to
    # cancellation in fp32 (an error of |G| * 6e-8 in the exponent)
    G = g.double().cumsum(2)                                     # [B, n, C, D]
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    decay = (G[:, :, :, None] - G[:, :, None]).float().masked_fill(~lower[:, :, None], float("-inf")).exp()
    G = G.float()
    inner = (decay * x[:, :, None]).sum(3)                       # [B, n, C(t), D]: from a zero start
    h = x.new_zeros(b, d) if initial_state is None else initial_state.float().clone()
    o = torch.empty_like(x)
    for i in range(x.shape[1]):
        o[:, i] = inner[:, i] + G[:, i].exp() * h[:, None]
        h = o[:, i, -1]
    o = o.reshape(b, -1, d)[:, :t]
    if cu_seqlens is not None:
        o = _unpad(o, lens)
    return o.to(dtype), (h if output_final_state else None)
