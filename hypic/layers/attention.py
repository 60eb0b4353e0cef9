"""Gated full attention (Qwen3.5 / Qwen3-Next) over a planned batch.

q_proj emits [query | gate] per head; q and k get a per-head RMSNorm, then partial RoPE at each
token's absolute position; the output is multiplied by sigmoid(gate). Cached segments keep
*pre-RoPE* keys, so placing a segment at any position is one rotation, done here at use.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..runtime.batch import Apply, ForwardBatch
from ..runtime.state import KVBuffer
from .norm import RMSNorm


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.rotary = [rotary]          # shared module, kept out of this module's parameters
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hs, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hs, self.nh * self.hd * 2, bias=bias)
        self.k_proj = nn.Linear(hs, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(hs, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, hs, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        L, n = self.layer_idx, x.shape[0]
        rot = self.rotary[0]
        q, gate = self.q_proj(x).view(n, self.nh, 2 * self.hd).chunk(2, dim=-1)
        q = self.q_norm(q)
        k_raw = self.k_norm(self.k_proj(x).view(n, self.nkv, self.hd))
        v = self.v_proj(x).view(n, self.nkv, self.hd)
        if "rope" not in batch.scratch:
            batch.scratch["rope"] = rot.cos_sin(batch.positions, x.dtype)
        cos, sin = batch.scratch["rope"]
        q, k = rot.apply(q, cos, sin), rot.apply(k_raw, cos, sin)
        out = x.new_empty(n, self.nh, self.hd)
        for seq in batch.seqs:
            buf = seq.state.kv.get(L)
            if buf is None:
                buf = seq.state.kv[L] = KVBuffer(self.nkv, self.hd, self.hd, dtype=x.dtype, device=x.device,
                                                 capacity=seq.state.capacity_hint)
            for piece in seq.pieces:
                if isinstance(piece, Apply):
                    kv = piece.entry.attn[L]
                    pos = torch.arange(piece.position, piece.position + kv.k.shape[0], device=x.device)
                    c, s = rot.cos_sin(pos, x.dtype)
                    buf.append(rot.apply(kv.k.to(x.dtype), c, s), kv.v.to(x.dtype), pos)
                    continue
                sl = slice(piece.start, piece.end)
                buf.append(k[sl], v[sl], batch.positions[sl])
                if piece.summarize:
                    piece.captures[L] = {"k": k_raw[sl].clone(), "v": v[sl].clone()}
                if piece.mark:
                    piece.captures[L] = {"k": k[sl].clone(), "v": v[sl].clone(), "pos": batch.positions[sl].clone()}
            kk, vv, pp = buf.view()
            sl = slice(seq.start, seq.end)
            out[sl] = self.ops.position_attention(q[sl], kk, vv, batch.positions[sl], pp, scale=self.scale)
        out = out.reshape(n, self.nh * self.hd) * torch.sigmoid(gate.reshape(n, self.nh * self.hd))
        return self.o_proj(out)
