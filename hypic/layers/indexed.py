"""Indexed sparse attention (Qwen4-Exp's QSA): an indexer picks, per query, the blocks of keys the attention reads.

The indexer projects every token to `heads` query vectors and one raw key (no norm, no RoPE). For a query at
position t, the visible positions 0..t are cut into blocks of `block` consecutive positions counted from 0; each
complete block's key is the mean of its raw keys, normed, then RoPE'd at the block's first position; a block scores
sum_h relu(q_h . key) / sqrt(d), and the query reads the `top` best complete blocks plus the incomplete last one
(every block while there are at most `top`: dense causal attention).

For PIC the raw keys are what is cached: they are position free, so the indexer is a stateful mixer of its own
(`IndexerKeys`, id num_layers + layer) whose buffer, entries and prefix nodes hold them exactly as an attention layer
holds its keys. Blocks and scores are not cached: they depend on where a segment lands (block boundaries are absolute
positions, a block may straddle two segments) and on every other key, so every forward pools the request's raw keys
at their true positions and selects per query, as a full recomputation does on the same keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..runtime.batch import ForwardBatch
from .attention import AttentionMixer, GatedAttention
from .norm import RMSNorm


SCORE_BYTES = 64 << 20         # the selection's per-head scores are made for this many bytes of queries at a time
MASK_ELEMENTS = 64 << 20       # an indexed layer attends for this many [query, key] mask elements at a time


class IndexerKeys(AttentionMixer):
    """The QSA indexer of one layer: its parameters (transformers' names, under `self_attn.indexer`) and, as a stateful
    mixer, the request's raw indexer keys (one head, no values). Driven by its attention layer (`IndexedAttention`),
    never called as a layer itself."""

    num_kv_heads = 1
    value_dim = 0
    scale = 1.0
    planned_only = True

    def __init__(self, cfg: ModelConfig, mixer_id: int, ops, rotary):
        super().__init__(mixer_id, ops)
        p = cfg.params
        self.heads, self.key_dim = p.indexer_n_heads, p.indexer_head_dim
        self.block, self.top = p.indexer_compress_ratio, p.indexer_budget // p.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.heads + 1) * self.key_dim, bias=False)
        self.q_layernorm = RMSNorm(self.key_dim, cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.key_dim, cfg.rms_norm_eps)
        self.rotary = (rotary,)                    # the attention's table (a tuple: not registered as a submodule)
        if rotary.rotary_dim > self.key_dim:
            raise ValueError(f"indexer head dim {self.key_dim} < the rotary dim {rotary.rotary_dim}")

    def project(self, x, batch):
        n = x.shape[0]
        q, k = self.index_qk_proj(x).split([self.heads * self.key_dim, self.key_dim], dim=-1)
        return q.view(n, self.heads, self.key_dim), k.view(n, 1, self.key_dim), x.new_empty(n, 1, 0), None

    def forward(self, x, batch):
        raise RuntimeError("the indexer runs inside its attention layer (IndexedAttention)")

    def collect(self, x: torch.Tensor, batch: ForwardBatch):
        """The active tokens' indexer queries (normed, RoPE'd at their positions) and, per sequence (by id), its raw
        keys and their positions after this forward's keys were stored."""
        q, k, v, _ = self.project(x, batch)
        rot = self.rotary[0]
        cos, sin = rot.cos_sin(batch.positions, q.dtype)
        q = rot.apply(self.q_layernorm(q), cos, sin)
        views = {id(seq): (kk, pp) for seq, kk, _, pp, _ in self.store(x, batch, k, k, v)}
        return q, views

    def select(self, q, q_pos, keys, key_pos, attn_pos):
        """allowed [Nq, Nk] bool over the attention's keys (positions attn_pos) for the queries q [Nq, heads, d] at
        q_pos, from the raw keys [n, 1, d] at key_pos (one per position 0..n-1, in any order); None where every query
        reads every visible key (at most `top` complete blocks)."""
        nq_blocks = torch.div(q_pos + 1, self.block, rounding_mode="floor")           # each query's complete blocks
        if int(nq_blocks.max()) <= self.top:
            return None
        n = keys.shape[0]
        if int(key_pos.max()) + 1 != n:
            raise RuntimeError("indexed attention needs one key per position 0..n-1 (a request's own positions)")
        raw = keys.new_empty(n, self.key_dim)
        raw[key_pos] = keys[:, 0]                                                     # in position order
        nb = n // self.block
        pooled = raw[: nb * self.block].view(nb, self.block, self.key_dim).float().mean(1).to(keys.dtype)
        rot = self.rotary[0]
        starts = torch.arange(nb, device=keys.device) * self.block
        cos, sin = rot.cos_sin(starts, keys.dtype)
        pooled = rot.apply(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0]
        valid = torch.arange(nb, device=keys.device)[None, :] < nq_blocks[:, None]        # complete for that query
        chosen = torch.zeros(q.shape[0], nb + 1, dtype=torch.bool, device=keys.device)
        pf = pooled.float()
        # queries in slices: the per-head scores are [queries, blocks, heads] fp32 before the relu and the sum
        step = max(1, SCORE_BYTES // (4 * nb * self.heads))
        for a in range(0, q.shape[0], step):
            b = min(a + step, q.shape[0])
            sc = torch.relu(torch.einsum("qhd,bd->qbh", q[a:b].float(), pf)).sum(-1) / math.sqrt(self.key_dim)
            top = sc.masked_fill(~valid[a:b], float("-inf")).topk(min(self.top, nb), dim=-1).indices
            chosen[a:b, :nb] = torch.zeros_like(valid[a:b]).scatter_(1, top, True) & valid[a:b]
        block_of = torch.div(attn_pos, self.block, rounding_mode="floor").clamp(max=nb)
        tail = attn_pos[None, :] >= (nq_blocks * self.block)[:, None]                   # the incomplete last block
        return chosen[:, block_of] | tail


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention (q/k norms, partial RoPE, sigmoid output gate) reading the keys its indexer selects.
    Runs on the planned paths only (dynamic decode, eager compose: `planned_only`)."""

    planned_only = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.indexer = IndexerKeys(cfg, cfg.num_layers + layer_idx, ops, rotary)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.static is not None or batch.captured is not None:
            raise RuntimeError("indexed attention runs on the planned paths only")
        qi, views = self.indexer.collect(x, batch)
        q, k_raw, v, gate = self.project(x, batch)
        q = self.place_queries(q, batch.positions, batch)
        k = self.place_keys(k_raw, batch.positions, batch)
        out = None
        for seq, kk, vv, pp, ordered in self.store(x, batch, k_raw, k, v):
            ik, ipos = views[id(seq)]
            # queries in slices whose selection masks ([queries, keys], and SDPA's copy of it) stay bounded
            step = max(1, MASK_ELEMENTS // max(1, pp.shape[0]))
            for a in range(seq.start, seq.end, step):
                sl = slice(a, min(a + step, seq.end))
                allowed = self.indexer.select(qi[sl], batch.positions[sl], ik, ipos, pp)
                o = self.attend(q[sl], kk, vv, batch.positions[sl], pp, contiguous=ordered and step >= seq.end - a,
                                allowed=allowed)
                if out is None:
                    out = o.new_empty((x.shape[0],) + tuple(o.shape[1:]))
                out[sl] = o
        if out is None:
            return self.no_tokens(x)
        return self.output(x, out, gate)
