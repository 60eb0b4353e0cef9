"""Top-k routed mixture of experts, pure PyTorch reference.

Layout:
    x          [N, Hd]
    router     [E, Hd]
    gate_up    [E, 2I, Hd]   per expert: gate rows then up rows
    down       [E, Hd, I]
Softmax over all experts in fp32, keep the top k, optionally renormalise them to sum to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x, router, top_k: int, norm_topk_prob: bool):
    """Returns (weights [N, k] in x's dtype, experts [N, k] int64)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def experts_forward(x, weights, experts, gate_up, down):
    """sum_k weights[:, k] * down_e(silu(gate_e x) * up_e x), looping over the experts in use."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
