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


def route(x, router, top_k: int, norm_topk_prob: bool, logits=None):
    """Returns (weights [N, k] in x's dtype, experts [N, k] int64). logits: x router^T where the caller has it (a
    joined GEMM's columns, layers/mlp.py)."""
    probs = torch.softmax(F.linear(x, router) if logits is None else logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def clamped_swiglu(gate, up, limit: float | None):
    """silu(gate) * up, with GLM-5 Next's clamps where `limit` is given: gate at most limit, up within +-limit."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def experts_forward(x, weights, experts, gate_up, down, limit: float | None = None, shared=None, rows=None):
    """sum_k weights[:, k] * down_e(silu(gate_e x) * up_e x), looping over the experts in use; `limit`: the SwiGLU's
    inputs clamped (clamped_swiglu); shared: (gate [N, 1], out [N, H]) of a shared expert, sigmoid(gate) * out added
    (`with_shared`). rows: padding (`pad_weights`)."""
    weights = pad_weights(weights, rows)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, limit), down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return with_shared(out, shared)


def pad_weights(weights, rows):
    """rows ([1] int tensor on the weights' device, or None): rows from `rows` on are padding (the compose pass's pad
    tokens, runtime/compose_graph.py): they take no routed expert, their routed sum is zero (a shared expert's part
    stays). Here by zero weights (the fast backend leaves their choices out of every expert's rows instead: pads, which
    all route alike, had piled onto one top-k set of experts)."""
    if rows is None:
        return weights
    live = torch.arange(weights.shape[0], device=weights.device) < rows
    return weights * live.to(weights.dtype)[:, None]


def with_shared(y, shared):
    """The routed experts' y plus a shared expert's output times the sigmoid of its gate (shared: (gate, out)), as
    Qwen's MoE blocks add it; y itself without one."""
    if shared is None:
        return y
    gate, out = shared
    return y + torch.sigmoid(gate) * out


def experts_forward_plain(x, weights, experts, up, down, act: str = "relu2"):
    """Non-gated experts (Nemotron 3): sum_k weights[:, k] * down_e(act(up_e x)); up [E, I, Hd], down [E, Hd, I];
    act "relu2" (relu squared). Accumulated in fp32, as transformers does; returned in x's dtype."""
    if act != "relu2":
        raise ValueError(f"unknown expert activation {act!r}")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        y = F.linear(F.relu(F.linear(x[tok], up[e])).square(), down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def route_grouped_sigmoid(x, router, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                          scaling: float, eps: float = 1e-20):
    """DeepSeek-V3 / Kimi routing: sigmoid scores (fp32); experts are chosen by score + bias within the
    best `topk_group` of `n_group` groups (a group's score: the sum of its top two); the weights are
    the unbiased scores, optionally renormalised (sum + eps: LFM2-MoE adds 1e-6), times `scaling`. Returns
    (weights fp32 [N, k], experts)."""
    scores = F.linear(x.float(), router.float()).sigmoid()
    choice = scores + bias.float()
    n, e = choice.shape
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    mask = mask[:, :, None].expand(n, n_group, e // n_group).reshape(n, e)
    experts = torch.topk(choice.masked_fill(~mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scaling, experts
