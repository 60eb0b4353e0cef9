"""Attention whose queries and keys sit at arbitrary absolute positions, pure PyTorch reference.

Layout:
    q      [Nq, H, D]        queries of one sequence
    k, v   [Nk, Hkv, D(v)]   keys/values of the same sequence, in any order (post-RoPE keys)
    q_pos  [Nq], k_pos [Nk]  absolute positions (int64)
Causal by position: query i sees key j iff k_pos[j] <= q_pos[i] (and, with a sliding window W,
q_pos[i] - k_pos[j] < W). Keys may come from cached
segments placed at new positions, a prefix cache and fresh tokens, in any order: softmax does
not care about order, only the mask does.
"""

from __future__ import annotations

import torch


def position_attention(q, k, v, q_pos, k_pos, *, scale: float, contiguous: bool = False, sorted_keys: bool = False,
                       window: int = 0, allowed=None):
    """contiguous, sorted_keys (hints the fast backend uses; the mask here is the same either way): the keys
    are exactly the queries' tokens, in position order; k_pos is non-decreasing. window > 0: sliding-window
    attention, a key visible only to queries fewer than `window` positions after it. allowed [Nq, Nk] bool: a
    selection of keys per query on top of causality (indexed sparse attention); every query must keep one key."""
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    rep = h // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = k_pos[None, :] <= q_pos[:, None]                              # [Nq, Nk]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    if allowed is not None:
        mask &= allowed
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def decode_attention(q, k, v, lengths, *, scale: float, allowed=None):
    """One new query per sequence over that sequence's cached keys (a decode step).

    q [B, H, D]; k [B, Hkv, C, D], v [B, Hkv, C, Dv]: C slots per sequence, of which the first
    lengths[b] are valid (the query's own key included); lengths [B] int64. Returns [B, H, Dv].
    Every valid key precedes the query, so no position mask is needed beyond the length. allowed [B, C] bool:
    a selection of the valid slots (indexed sparse attention; each row keeps at least one)."""
    out = []
    for b, n in enumerate(lengths.tolist()):
        kk, vv = k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1)       # [n, Hkv, D]
        zero = torch.zeros(1, dtype=torch.long, device=q.device)
        sel = None if allowed is None else allowed[b : b + 1, :n]
        out.append(position_attention(q[b : b + 1], kk, vv, zero, zero.expand(n), scale=scale, allowed=sel))
    return torch.cat(out)


def order_keys(keys, values, kperm, *, free=None, lo: int = 0, cos=None, sin=None, rotary_dim: int = 0, out=None,
               entries=None):
    """The compose pass's keys and values in position order (the attention's operands), with a cached run of keys
    placed first.

    keys, values [N, Hkv, D(v)]: every key of the pass as its buffers hold them ([held | cached | active]).
    kperm [N] (int64): the rows of keys / values in position order (a permutation of 0..N-1).
    free [n, Hkv, D] (optional): the cached segments' position-free keys, with cos, sin [n, >= rotary_dim]
    (rotate-half tables in keys' dtype, the second half repeating the first): keys[lo : lo + n] is overwritten
    in place by free placed at those positions (RoPE over each head's first rotary_dim dims, the rest copied;
    the buffer keeps them: they are the request's keys after the pass), before the gather. The products and
    sums in the roundings of `layers/rope.Rotary.apply_into` (x1 c - x2 s and x2 c + x1 s, each product
    rounded to the dtype first).
    out (optional): (ok, ov) of keys' and values' shapes and dtypes to write them into (fixed buffers).
    entries: the fast backend's form that reads the cached rows in place by address (ops/triton_place.py); here the
    packed rows are the form, so it is refused.
    Returns (keys[kperm], values[kperm])."""
    if entries is not None:
        raise ValueError("order_keys: the reference reads the cached keys packed (free), not by address")
    if free is not None:
        rope_into(free, cos, sin, keys[lo : lo + free.shape[0]], rotary_dim)
    if out is None:
        return keys[kperm], values[kperm]
    torch.index_select(keys, 0, kperm, out=out[0])
    torch.index_select(values, 0, kperm, out=out[1])
    return out


def rope_into(x, cos, sin, out, rotary_dim: int) -> None:
    """Rotate-half RoPE of x [N, H, D] over each head's first rotary_dim dims written into out (the rest copied):
    x1 c - x2 s and x2 c + x1 s, each product rounded to the dtype, then the sum; cos, sin [N, >= rotary_dim / 2]
    (their first halves are read). `layers/rope.Rotary.apply_into` and `order_keys` both place keys this way."""
    r, h = rotary_dim, rotary_dim // 2
    if r:
        c, s = cos[:, None, :h], sin[:, None, :h]
        x1, x2 = x[..., :h], x[..., h:r]
        torch.sub(x1 * c, x2 * s, out=out[..., :h])
        torch.add(x2 * c, x1 * s, out=out[..., h:r])
    out[..., r:].copy_(x[..., r:])
