"""Gated linear attention without erasure (GLA: a decay per key channel; simple GLA / lightning /
Mamba2: one decay per head), pure PyTorch reference.

Layout (fla's convention):
    q, k   [B, T, H, K]      H key heads; each serves HV // H consecutive value heads
    v      [B, T, HV, V]
    g      [B, T, HV, K]     log decay per key channel (<= 0)   chunk_gla / recurrent_gla
           [B, T, HV]        log decay per head                  chunk_simple_gla / recurrent_simple_gla
    state  [N, HV, K, V]     fp32; varlen: B = 1 and cu_seqlens [N + 1]
Recurrence for one value head (S is [K, V]):
    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale * q_t)
so a segment's transition T is diagonal (a K-vector per head), or a scalar per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gated_delta import _expand_heads, _pad_varlen, _unpad


def _prepare(q, k, v, g, scale):
    hv = v.shape[-2]
    q, k = _expand_heads(q, hv).float(), _expand_heads(k, hv).float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g[..., None]                                        # per head: broadcast over K
    return q * scale, k, v.float(), g.float()


def recurrent_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Token-by-token reference. Returns (o [B, T, HV, V] in v's dtype, final_state fp32 or None)."""
    dtype = v.dtype
    if cu_seqlens is not None:
        (q, k, v, g), lens = _pad_varlen((q, k, v, g), cu_seqlens)
    q, k, v, g = _prepare(q, k, v, g, scale)
    b, t, hv, dv = v.shape
    s = q.new_zeros(b, hv, k.shape[-1], dv) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(b, t, hv, dv)
    for i in range(t):
        s = s * g[:, i].exp()[..., None] + k[:, i, :, :, None] * v[:, i, :, None, :]
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], s)
    if cu_seqlens is not None:
        o = _unpad(o, lens)
    return o.to(dtype), (s if output_final_state else None)


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size=16):
    """Chunked form. Within a chunk, G_t = cumulative log decay from the chunk start ([.., K] or [.., 1]):
        o_t = (q_t * exp(G_t))^T S_0 + sum_{s<=t} (q_t . (exp(G_t - G_s) * k_s)) v_s
        S_C = exp(G_C) * S_0 + sum_s (exp(G_C - G_s) * k_s) v_s^T
    Pairwise decays are formed as exp(G_t - G_s) (never exp(-G_s) alone), so long chunks of strong
    decay cannot overflow. They are a [C, C, Kg] tensor per chunk, so the work grows with C: 16 is
    4-7x faster than 64 on the CPU for per-channel decays (measured 2026-11-30)."""
    dtype = v.dtype
    if cu_seqlens is not None:
        (q, k, v, g), lens = _pad_varlen((q, k, v, g), cu_seqlens)
    q, k, v, g = _prepare(q, k, v, g, scale)
    b, t, hv, dv = v.shape
    dk, c = k.shape[-1], chunk_size
    pad = (-t) % c
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(b, hv, -1, c, x.shape[-1]) for x in (q, k, v, g))
    G = g.cumsum(-2)                                            # [B, HV, n, C, Kg]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = G[..., :, None, :] - G[..., None, :, :]              # [B, HV, n, C(t), C(s), Kg]
    decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()
    scores = (q[..., :, None, :] * k[..., None, :, :] * decay).sum(-1)            # [B, HV, n, C, C]
    q_decay = q * G.exp()
    k_tail = k * (G[..., -1:, :] - G).exp()
    chunk_decay = G[..., -1, :].exp()                           # [B, HV, n, Kg]
    s = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.float().clone()
    o = torch.empty_like(v)
    for i in range(q.shape[2]):
        o[:, :, i] = q_decay[:, :, i] @ s + scores[:, :, i] @ v[:, :, i]
        s = s * chunk_decay[:, :, i, :, None] + k_tail[:, :, i].transpose(-1, -2) @ v[:, :, i]
    o = o.reshape(b, hv, -1, dv)[:, :, :t].transpose(1, 2)
    if cu_seqlens is not None:
        o = _unpad(o, lens)
    return o.to(dtype), (s if output_final_state else None)


def recurrent_simple_gla(q, k, v, g, **kw):
    """Scalar decay per head (g [B, T, HV]): lightning attention, RetNet, Mamba2's SSD."""
    return recurrent_gla(q, k, v, g, **kw)


def chunk_simple_gla(q, k, v, g, **kw):
    return chunk_gla(q, k, v, g, **kw)
