"""Indexed sparse attention (Qwen4-Exp's QSA): an indexer picks, per query, the blocks of keys the attention reads.

The indexer projects every token to `heads` query vectors and one raw key (no norm, no RoPE). For a query at
position t, the visible positions 0..t are cut into blocks of `block` consecutive positions counted from 0; each
complete block's key is the mean of its raw keys, normed, then RoPE'd at the block's first position; a block scores
sum_h relu(q_h . key) / sqrt(d), and the query reads the `top` best complete blocks plus the incomplete last one
(every block while there are at most `top`: dense causal attention).

GLM-5 Next's DSA indexer (`PooledIndexerKeys`) differs in how a block ("pool") is summarised and scored: its key
is a softmax-weighted average of the tokens' keys (per channel, weights from a per-token gate plus a learned bias per
offset in the pool), and a pool scores sum_h w_h relu(q_h . key / sqrt(d)) with per-token head weights w; its queries
come from the attention's query latent. Blocks, their alignment at position 0, the top-k per query and the incomplete
last block are the same.

For PIC the raw keys are what is cached: they are position free, so the indexer is a stateful mixer of its own
(`IndexerKeys`, id num_layers + layer) whose buffer, entries and prefix nodes hold them exactly as an attention layer
holds its keys. Blocks and scores are not cached: they depend on where a segment lands (block boundaries are absolute
positions, a block may straddle two segments) and on every other key, so every forward pools the request's raw keys
at their true positions and selects per query, as a full recomputation does on the same keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..runtime.batch import ForwardBatch
from .attention import AttentionMixer, GatedAttention
from .mla import MultiHeadLatentAttention
from .norm import RMSNorm


SCORE_BYTES = 64 << 20         # the selection's per-head scores are made for this many bytes of queries at a time
MASK_ELEMENTS = 64 << 20       # an indexed layer attends for this many [query, key] mask elements at a time


class _Indexer(AttentionMixer):
    """What both indexers share as stateful mixers: per-token raw keys (one head, no values) stored and cached like
    attention keys, and the selection from blocks of `block` positions counted from 0 (`select`). A subclass writes
    `project` (its queries' inputs and raw keys), `queries` and `pool` / `scores`. Driven by its attention layer,
    never called as a layer itself."""

    num_kv_heads = 1
    value_dim = 0
    scale = 1.0
    planned_only = True
    block: int
    top: int

    def forward(self, x, batch):
        raise RuntimeError("the indexer runs inside its attention layer")

    def queries(self, x, q, batch: ForwardBatch, extra) -> tuple:
        """The active tokens' query tensors (each [Nq, ...]) from project's q."""
        raise NotImplementedError

    def pool(self, raw: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """raw [nb, block, key_dim] (complete blocks, each's tokens in position order), starts [nb] (each block's
        first position) -> the blocks' keys [nb, d] as scored."""
        raise NotImplementedError

    def scores(self, q: tuple, pooled: torch.Tensor) -> torch.Tensor:
        """[Nq, nb] fp32 block scores for the queries (a slice of `queries`' tensors) against pooled [nb, d] (the same
        blocks for every query) or [Nq, nb, d] (each query its own: a decode step's rows)."""
        raise NotImplementedError

    def collect(self, x: torch.Tensor, batch: ForwardBatch, extra=None):
        """The active tokens' indexer queries and, per sequence (by id), its raw keys and their positions after this
        forward's keys were stored."""
        q, k, v, _ = self.project(x, batch)
        views = {id(seq): (kk, pp) for seq, kk, _, pp, _ in self.store(x, batch, k, k, v)}
        return self.queries(x, q, batch, extra), views

    def select(self, q: tuple, q_pos, keys, key_pos, attn_pos):
        """allowed [Nq, Nk] bool over the attention's keys (positions attn_pos) for the queries q (tensors [Nq, ...])
        at q_pos, from the raw keys [n, 1, key_dim] at key_pos (one per position 0..n-1, in any order); None where
        every query reads every visible key (at most `top` complete blocks)."""
        nq_blocks = torch.div(q_pos + 1, self.block, rounding_mode="floor")           # each query's complete blocks
        if int(nq_blocks.max()) <= self.top:
            return None
        n = keys.shape[0]
        if int(key_pos.max()) + 1 != n:
            raise RuntimeError("indexed attention needs one key per position 0..n-1 (a request's own positions)")
        raw = keys.new_empty(n, keys.shape[-1])
        raw[key_pos] = keys[:, 0]                                                     # in position order
        nb = n // self.block
        pooled = self.pool(raw[: nb * self.block].view(nb, self.block, -1),
                           torch.arange(nb, device=keys.device) * self.block)
        valid = torch.arange(nb, device=keys.device)[None, :] < nq_blocks[:, None]        # complete for that query
        chosen = torch.zeros(q_pos.shape[0], nb + 1, dtype=torch.bool, device=keys.device)
        # queries in slices: the per-head scores are [queries, heads, blocks] fp32 before the reduction over heads
        step = max(1, SCORE_BYTES // (4 * nb * self.heads))
        for a in range(0, q_pos.shape[0], step):
            b = min(a + step, q_pos.shape[0])
            sc = self.scores(tuple(t[a:b] for t in q), pooled)
            top = sc.masked_fill(~valid[a:b], float("-inf")).topk(min(self.top, nb), dim=-1).indices
            chosen[a:b, :nb] = torch.zeros_like(valid[a:b]).scatter_(1, top, True) & valid[a:b]
        block_of = torch.div(attn_pos, self.block, rounding_mode="floor").clamp(max=nb)
        tail = attn_pos[None, :] >= (nq_blocks * self.block)[:, None]                   # the incomplete last block
        return chosen[:, block_of] | tail

    def select_rows(self, q: tuple, q_pos, st, attn_pos) -> torch.Tensor:
        """`select` for a decode step over fixed buffers, no host sync: row r's query q[r] at q_pos[r] over the raw
        keys of its row of st (StaticKV: slots in any order, their positions st.pos, st.n valid; one key per
        position 0..n-1), for the attention's slots at positions attn_pos [R, C]. Every row pools all C // block
        blocks its buffer could hold (those not complete for its query masked), so shapes depend on the buffers
        alone. Returns allowed [R, C] (slots past a row's length are the caller's to mask)."""
        rows, cap = st.pos.shape
        nb = cap // self.block
        slot = torch.arange(cap, device=st.pos.device)[None, :]
        at = torch.where(slot < st.n[:, None], st.pos, cap)                   # invalid slots into a spare row
        raw = st.k.new_zeros(rows, cap + 1, st.k.shape[-1])
        raw.scatter_(1, at[..., None].expand(-1, -1, raw.shape[-1]), st.k[:, 0])         # [R, C + 1, d] in position order
        starts = (torch.arange(nb, device=raw.device) * self.block).repeat(rows)
        pooled = self.pool(raw[:, : nb * self.block].reshape(rows * nb, self.block, -1), starts).view(rows, nb, -1)
        nq_blocks = torch.div(q_pos + 1, self.block, rounding_mode="floor")               # [R]
        valid = torch.arange(nb, device=raw.device)[None, :] < nq_blocks[:, None]
        chosen = torch.zeros(rows, nb + 1, dtype=torch.bool, device=raw.device)
        if nb:
            sc = self.scores(q, pooled)
            top = sc.masked_fill(~valid, float("-inf")).topk(min(self.top, nb), dim=-1).indices
            chosen[:, :nb] = torch.zeros_like(valid).scatter_(1, top, True) & valid
        block_of = torch.div(attn_pos, self.block, rounding_mode="floor").clamp(0, nb)
        tail = attn_pos >= (nq_blocks * self.block)[:, None]
        return chosen.gather(1, block_of) | tail


class IndexerKeys(_Indexer):
    """Qwen4-Exp's QSA indexer (parameters under `self_attn.indexer`, transformers' names): queries and raw keys from
    one projection of the layer input; a block's key is the mean of its raw keys, normed (zero-centred) and RoPE'd at
    the block's first position; the queries normed and RoPE'd at theirs; a block scores sum_h relu(q_h . key) /
    sqrt(d)."""

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

    def queries(self, x, q, batch, extra):
        rot = self.rotary[0]
        cos, sin = rot.cos_sin(batch.positions, q.dtype)
        return (rot.apply(self.q_layernorm(q), cos, sin),)

    def pool(self, raw, starts):
        pooled = raw.float().mean(1).to(raw.dtype)
        rot = self.rotary[0]
        cos, sin = rot.cos_sin(starts, raw.dtype)
        return rot.apply(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0]

    def scores(self, q, pooled):
        eq = "qhd,bd->qhb" if pooled.dim() == 2 else "qhd,qbd->qhb"
        return torch.relu(torch.einsum(eq, q[0].float(), pooled.float())).sum(1) / math.sqrt(self.key_dim)


class PooledIndexerKeys(_Indexer):
    """GLM-5 Next's DSA indexer with gated pooling (parameters under `self_attn.indexer`, transformers' names): per
    token a key LayerNorm(wk x) and pooling logits x W_gate^T, stored side by side as the raw key [k | g]; queries
    wq_b(the attention's query latent), no norm, no RoPE (NoPE); head weights weights_proj(x) / sqrt(heads). A pool's
    key: sum over its tokens of softmax_tokens(g + ape[offset]) * k, per channel; its score sum_h w_h
    relu(q_h . key / sqrt(d))."""

    def __init__(self, cfg: ModelConfig, mixer_id: int, ops):
        super().__init__(mixer_id, ops)
        p = cfg.params
        self.heads, self.d = p.index_n_heads, p.index_head_dim
        self.key_dim = 2 * self.d
        self.block, self.top = p.index_kpool, p.index_topk // p.index_kpool
        self.wq_b = nn.Linear(p.q_lora_rank, self.heads * self.d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.d, bias=False)
        self.k_norm = nn.LayerNorm(self.d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.block, self.d))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.d, cfg.hidden_size))

    def project(self, x, batch):
        n = x.shape[0]
        k = torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)], dim=-1)
        return None, k.view(n, 1, self.key_dim), x.new_empty(n, 1, 0), None

    def queries(self, x, q, batch, q_latent):
        n = x.shape[0]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads ** -0.5
        return self.wq_b(q_latent).view(n, self.heads, self.d), w

    def pool(self, raw, starts):
        k, g = raw[..., : self.d], raw[..., self.d :]
        w = torch.softmax(g.float() + self.index_kpool_compress_ape.float()[None], dim=1).to(k.dtype)
        return (w * k).sum(1)

    def scores(self, q, pooled):
        qh, w = q
        eq = "qhd,bd->qhb" if pooled.dim() == 2 else "qhd,qbd->qhb"
        sc = torch.relu(torch.einsum(eq, qh.float(), pooled.float()) * self.d ** -0.5)
        return torch.einsum("qh,qhb->qb", w, sc)


class _IndexedForward:
    """The forward of an attention layer whose keys an indexer (`self.indexer`) selects: the indexer's keys stored
    and its queries made (from the layer input and the attention's `project` extra), then per sequence, in query
    slices of bounded mask size, the selection and the attention under it."""

    planned_only = True                   # the compose pass on the planned paths (decode: fixed buffers too)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.static is not None:
            return self._forward_static(x, batch)
        if batch.captured is not None:
            raise RuntimeError("indexed attention composes on the planned paths only")
        q, k_raw, v, extra = self.project(x, batch)
        qi, views = self.indexer.collect(x, batch, extra)
        q = self.place_queries(q, batch.positions, batch)
        k = self.place_keys(k_raw, batch.positions, batch)
        out = None
        for seq, kk, vv, pp, ordered in self.store(x, batch, k_raw, k, v):
            ik, ipos = views[id(seq)]
            # queries in slices whose selection masks ([queries, keys], and SDPA's copy of it) stay bounded
            step = max(1, MASK_ELEMENTS // max(1, pp.shape[0]))
            for a in range(seq.start, seq.end, step):
                sl = slice(a, min(a + step, seq.end))
                allowed = self.indexer.select(tuple(t[sl] for t in qi), batch.positions[sl], ik, ipos, pp)
                o = self.attend(q[sl], kk, vv, batch.positions[sl], pp, contiguous=ordered and step >= seq.end - a,
                                allowed=allowed)
                if out is None:
                    out = o.new_empty((x.shape[0],) + tuple(o.shape[1:]))
                out[sl] = o
        if out is None:
            return self.no_tokens(x)
        return self.output(x, out, extra)

    def static_selection(self, x, batch, extra, st):
        """A decode step over fixed buffers (AttentionMixer._forward_static): the indexer's raw key into its rows,
        then the selection from each row's raw keys (`select_rows`) over the attention's slots; no host sync."""
        ix = self.indexer
        iq, ik, iv, _ = ix.project(x, batch)
        ist = batch.static.layers[ix.layer_idx]
        ist.append(batch.static.rows, ik, iv, batch.positions)
        return ix.select_rows(ix.queries(x, iq, batch, extra), batch.positions, ist, st.pos)


class IndexedAttention(_IndexedForward, GatedAttention):
    """Qwen3.5's gated attention (q/k norms, partial RoPE, sigmoid output gate) reading the keys its QSA indexer
    selects. Composes on the planned paths (`planned_only`); decodes over fixed buffers too."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.indexer = IndexerKeys(cfg, cfg.num_layers + layer_idx, ops, rotary)


class IndexedLatentAttention(_IndexedForward, MultiHeadLatentAttention):
    """GLM-5 Next's MLA (NoPE; q through a LoRA latent; its norms at the config's eps) reading the keys its DSA
    indexer selects; the indexer's queries come from the query latent (`project`'s extra)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops, None, norm_eps=cfg.rms_norm_eps)
        self.indexer = PooledIndexerKeys(cfg, cfg.num_layers + layer_idx, ops)
