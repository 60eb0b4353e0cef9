"""Where each cold segment is prefilled when several ranks share the work (hypic.md 2.3).

An isolated prefill of an L-token segment costs per-token work in every layer (projections, MLP / MoE, the linear
recurrences) plus, in each full-attention layer, work that grows with L (every token attends to the ones before it).
Longest-processing-time-first (LPT) placement then sorts segments by that cost and gives each, in turn, to the rank
with the least work so far: within 4/3 of the best makespan, and far better than equal counts per rank when segment
lengths are uneven.
"""

from __future__ import annotations

from typing import Sequence

from ..config import ModelConfig


def segment_cost(length: int, cfg: ModelConfig) -> float:
    """Relative prefill cost of an isolated `length`-token run (the anchor counts: it runs too). Per token and layer
    a dense layer does ~ 24 h^2 multiply-adds (attention and MLP projections); an attention layer's score and value
    products add ~ 2 L h per token on average (L/2 keys, QK and PV). The unit is one token through one layer."""
    h = max(cfg.hidden_size, 1)
    attn = len(cfg.attention_layers)
    return float(length) * (cfg.num_layers + attn * length / (12.0 * h))


def lpt(costs: Sequence[float], ranks: int) -> list[list[int]]:
    """Indices of `costs` per rank, longest first, each to the least-loaded rank (ties: the lower rank, so rank 0,
    which also combines, takes the first and largest piece of work; one segment stays local)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    load = [0.0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += costs[i]
    return out


def round_robin(n: int, ranks: int) -> list[list[int]]:
    """Indices 0..n-1 dealt in order, equal counts per rank (rank 0 first): the placement that ignores length."""
    return [list(range(r, n, ranks)) for r in range(ranks)]


def chunks(indices: Sequence[int], tokens: Sequence[int], budget: int) -> list[list[int]]:
    """`indices` in order, cut into consecutive batches of at most `budget` tokens (a longer segment alone)."""
    out: list[list[int]] = []
    cur, n = [], 0
    for i in indices:
        if cur and n + tokens[i] > budget:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += tokens[i]
    if cur:
        out.append(cur)
    return out
