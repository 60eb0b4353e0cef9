"""Qwen4-Exp's per-layer n-gram embeddings (PLE) as stateful mixers, so that PIC carries their cross-token context.

A PLE layer adds, before the layer's hyper-connection, a term built from hashed n-grams of the token ids: for token t
the ids of the n-grams ending at t (orders 2..ngram_size, the earlier tokens reset to EOS past an EOS; a sequence
starts with an EOS history) are hashed per head into a table, the looked-up vectors E(t) give one key per residual
stream and a value, each stream's normed state gates the value (sign-preserving square root of the scaled dot
product, sigmoid), and a dilated causal conv (kernel K, dilation ngram_size) over the normed gated values adds local
context: out = gv + silu(conv(norm_conv(gv))).

Two things reach across tokens, and each is a `ConvOnlyMixer` (no recurrent state, as LFM2's short conv),
whose conv window is what the engine caches, hands on and composes:
- `TokenHistory`: the previous ngram_size - 1 token ids. Its conv inputs are the token ids, XOR-ed with EOS (so the
  zero window a sequence starts with reads as EOS) and cut into 8-bit digits (integers up to 256 are exact in bf16),
  and its conv is a fixed shift (lag 1 and lag 2 of every digit): exact in any float dtype;
- `PLEConv`: the dilated conv, as a dense causal conv of width (K - 1) * ngram_size + 1 with zero taps between.
So an isolated prefill reads a segment as a sequence start (EOS history), and placed later its seam tokens read the
previous segment's last tokens from that segment's cached tail: exact once the seam covers the conv warm-up.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.short_conv import ConvOnlyMixer

DIGITS, DIGIT_BITS = 3, 8                       # token ids below 2^24


def _splitmix64(v: int) -> int:
    m = (1 << 64) - 1
    v = (v + 0x9E3779B97F4A7C15) & m
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & m
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & m
    return (v ^ (v >> 31)) & m


def _prime_after(n: int) -> int:
    """The smallest prime above n."""
    n += 1
    while n < 2 or any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def ngram_tables(cfg: ModelConfig, ple_index: int):
    """(multipliers [ngram_size], head table sizes [G], head offsets [G], padded table rows) of PLE layer `ple_index`
    (its place in ple_layer_ids): per n-gram order heads_per_ngram heads, each a table of the next prime size above
    ngram_vocab_size_base (counting over every PLE layer's heads), odd multipliers from splitmix64."""
    p = cfg.params
    g = (p.ngram_size - 1) * p.heads_per_ngram
    sizes, size = [], p.ngram_vocab_size_base - 1
    for _ in range(ple_index * g):                 # the primes of earlier layers' heads
        size = _prime_after(size)
    for _ in range(g):
        size = _prime_after(size)
        sizes.append(size)
    offsets = [sum(sizes[:i]) for i in range(g)]
    half = max(1, (((1 << 63) - 1) // max(cfg.vocab_size, 1)) // 2)
    base = p.seed + 10007 * ple_index
    mults = [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (j + 1)) & ((1 << 64) - 1)) % half) + 1
             for j in range(p.ngram_size)]
    rows = math.ceil(sum(sizes) / p.make_ngram_vocab_size_divisible_by) * p.make_ngram_vocab_size_divisible_by
    return mults, sizes, offsets, rows


class TokenHistory(ConvOnlyMixer):
    """The previous `ngram_size - 1` token ids of every token (forward(ids as a float column, batch) -> [N, lags] int64
    ids), through a conv window of their digits."""

    def __init__(self, mixer_id: int, ops, lags: int, eos: int):
        super().__init__(mixer_id, ops)
        self.lags, self.eos = lags, eos
        self.conv_width = lags + 1
        # fixed shift kernels: not a checkpoint tensor, nor a buffer (a meta build would leave it on meta); moved to
        # the inputs' device and dtype at first use, as Rotary's tables are (0 and 1 are exact in any dtype)
        with torch.device("cpu"):
            self.shift = _shift_weights(lags, self.conv_width, "cpu", torch.float32)

    @property
    def conv_dim(self) -> int:
        return self.lags * DIGITS

    def conv_weights(self):
        return self.shift, None

    def features(self, x, batch):
        if self.shift.device != x.device or self.shift.dtype != x.dtype:
            self.shift = self.shift.to(x.device, x.dtype)
        ids = batch.input_ids.long() ^ self.eos                             # 0 reads as EOS (a zero window)
        digits = torch.stack([(ids >> (DIGIT_BITS * d)) & ((1 << DIGIT_BITS) - 1) for d in range(DIGITS)], -1)
        return {"raw": digits.repeat(1, self.lags).to(x.dtype)}           # one copy per lag

    def output(self, x, o, f):
        digits = o.float().round().long().view(-1, self.lags, DIGITS)
        ids = sum(digits[..., d] << (DIGIT_BITS * d) for d in range(DIGITS))
        return ids ^ self.eos                                               # [N, lags]: lag 1, lag 2, ...


def _shift_weights(lags: int, width: int, device, dtype):
    """[lags * DIGITS, width] depthwise kernels: copy j picks the input j + 1 steps back (weight index 0 is the
    oldest input of the window)."""
    w = torch.zeros(lags * DIGITS, width, device=device, dtype=dtype)
    for j in range(lags):
        w[j * DIGITS:(j + 1) * DIGITS, width - 2 - j] = 1.0
    return w


class PLEConv(ConvOnlyMixer):
    """The dilated causal conv over the normed gated values (forward(cat([normed, gv]), batch) -> gv + silu(conv)).
    `conv1d` is the PLE layer's module (named there, as the checkpoint names it)."""

    conv_activation = "silu"

    def __init__(self, mixer_id: int, ops, conv1d: nn.Conv1d):
        super().__init__(mixer_id, ops)
        self.channels, self.dilation = conv1d.in_channels, conv1d.dilation[0]
        self.conv_width = (conv1d.kernel_size[0] - 1) * self.dilation + 1
        self._conv = (conv1d,)

    @property
    def conv_dim(self) -> int:
        return self.channels

    def conv_weights(self):
        """The dilated kernel as a dense one: tap k at index k * dilation (index 0 the oldest input)."""
        w = self._conv[0].weight[:, 0]
        dense = w.new_zeros(self.channels, self.conv_width)
        dense[:, :: self.dilation] = w
        return dense, None

    def features(self, x, batch):
        raw, gv = x.split(self.channels, dim=-1)
        return {"raw": raw, "gv": gv}

    def output(self, x, o, f):
        return f["gv"] + o.to(f["gv"].dtype)


class PLE(nn.Module):
    """One PLE layer (transformers' names under `ple.`): the n-gram table, key / value projections, the three grouped
    norms and the dilated conv; the two stateful mixers carry the token history and the conv window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ple_index: int, ops, norm):
        super().__init__()
        p = cfg.params
        self.n, self.hidden = p.hc_count, cfg.hidden_size
        width = self.n * self.hidden
        mults, sizes, offsets, rows = ngram_tables(cfg, ple_index)
        self.ngram, self.heads_per = p.ngram_size, p.heads_per_ngram
        self.mults = mults
        with torch.device("cpu"):                        # plain tensors, moved at first use (see TokenHistory.shift)
            self.sizes, self.offsets = torch.tensor(sizes), torch.tensor(offsets)
        g = (p.ngram_size - 1) * p.heads_per_ngram
        self.ple_embedding = nn.Module()
        self.ple_embedding.ngram_embedding = nn.Embedding(rows, p.ple_embed_dim // g)
        self.key_proj = nn.Linear(p.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(p.ple_embed_dim, self.hidden, bias=False)
        self.norm_key, self.norm_query, self.norm_conv = (norm(width, self.hidden, cfg.rms_norm_eps) for _ in range(3))
        self.conv1d = nn.Conv1d(width, width, p.ple_conv_kernel_size, groups=width, dilation=p.ngram_size, bias=False)
        L = cfg.num_layers                             # mixer ids: the linear layer's, then these two
        self.history = TokenHistory(L + layer_idx, ops, p.ngram_size - 1, p.ple_eos)
        self.conv = (PLEConv(2 * L + layer_idx, ops, self.conv1d),)

    @property
    def mixers(self):
        return (self.history, self.conv[0])

    def ngram_ids(self, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """ids [N], prev [N, ngram - 1] (lag 1, 2, ...) -> [N, G] table rows: per order o the hash of the o-gram
        ending here (an earlier token past an EOS is EOS), per head its remainder plus the head's offset."""
        eos = self.history.eos
        shifted = [ids]
        stop = torch.zeros_like(ids, dtype=torch.bool)
        for j in range(prev.shape[1]):
            shifted.append(torch.where(stop, torch.full_like(ids, eos), prev[:, j]))
            stop = stop | (prev[:, j] == eos)
        out = []
        if self.sizes.device != ids.device:
            self.sizes, self.offsets = self.sizes.to(ids.device), self.offsets.to(ids.device)
        sizes, offsets = self.sizes, self.offsets
        for order in range(2, self.ngram + 1):
            mixed = shifted[0] * self.mults[0]
            for j in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[j] * self.mults[j])
            a = (order - 2) * self.heads_per
            out.append(torch.remainder(mixed[:, None], sizes[a:a + self.heads_per]) + offsets[a:a + self.heads_per])
        return torch.cat(out, dim=-1)

    def forward(self, h: torch.Tensor, batch) -> torch.Tensor:
        ids = batch.input_ids.long()
        prev = self.history(h, batch)
        if prev.shape[0] != ids.shape[0] or prev.dim() != 2:        # no active token
            return torch.zeros_like(h)
        e = self.ple_embedding.ngram_embedding(self.ngram_ids(ids, prev)).flatten(1)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.n, self.hidden))
        value = self.value_proj(e)
        query = self.norm_query(h).unflatten(-1, (self.n, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gv = (torch.sigmoid(gate) * value[:, None, :]).flatten(1)
        return self.conv[0](torch.cat([self.norm_conv(gv), gv], dim=-1), batch)
