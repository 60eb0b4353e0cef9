"""Feed-forward blocks: SwiGLU MLP and the routed MoE with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.reference.moe import clamped_swiglu
from .joined import JoinedWeights


def activation(name: str):
    """The elementwise activation a config names (transformers' ACT2FN names, the ones hybrids use)."""
    fns = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
           "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
           "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
    if name not in fns:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(fns)}")
    return fns[name]


class MLP(nn.Module):
    """SwiGLU; `limit`: its inputs clamped first (GLM-5 Next: gate at most limit, up within +-limit)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, limit: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.limit = limit

    def forward(self, x, rows=None):
        """rows: as the MoE blocks take it (padding from that row on); a dense MLP treats every row alike, so a
        decoder layer calls its MLP one way whichever it holds."""
        if self.limit is not None:
            return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.params.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    """Expert weights as 3-D tensors: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.params.num_experts, cfg.hidden_size, cfg.params.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops = ops
        p = cfg.params
        self.top_k, self.norm_topk = p.num_experts_per_tok, p.norm_topk_prob
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, p.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self._shared_in = JoinedWeights()

    def shared_in(self, x) -> tuple:
        """The shared expert's gate and up projections and its gate of x by one GEMM (three launches per layer
        before): [gate_proj | up_proj | shared_expert_gate] as one matrix (layers/joined.py)."""
        se = self.shared_expert
        return self._shared_in.linear(x, se.gate_proj.weight, se.up_proj.weight, self.shared_expert_gate.weight)

    def _input_weights(self) -> tuple:
        se = self.shared_expert
        return self.gate.weight, se.gate_proj.weight, se.up_proj.weight, self.shared_expert_gate.weight

    def _unbiased(self) -> bool:
        se = self.shared_expert
        return se.gate_proj.bias is None and se.up_proj.bias is None and self.shared_expert_gate.bias is None

    def joined_parts(self) -> list:
        """The router, the shared expert's gate and up projections and its gate packed into one matrix at load time
        (layers/joined.py pack_model): every GEMM of the layer's input but the routed experts' in one."""
        return [(self._shared_in, list(self._input_weights()))] if self._unbiased() else []

    def forward(self, x, rows=None):
        """rows ([1] int tensor or None): the rows from it on are padding, which no routed expert takes
        (ops/reference/moe.py `pad_weights`)."""
        se = self.shared_expert
        ws = self._input_weights()
        logits = None
        if se.gate_proj.bias is not None or se.up_proj.bias is not None:
            shared = (self.shared_expert_gate(x), se(x))
        else:
            if self._shared_in.packed(*ws) is not None:     # (packed: the router's logits from the same GEMM)
                logits, gate, up, sg = self._shared_in.linear(x, *ws)
            else:
                gate, up, sg = self.shared_in(x)
            shared = (sg, se.down_proj(self.ops.act_mul(gate, up)))
        weights, experts = self.ops.route(x, self.gate.weight, self.top_k, self.norm_topk, logits=logits)
        # y + sigmoid(gate) * out, added by the experts' combine (one kernel on the fast backend's few-rows path)
        return self.ops.experts_forward(x, weights, experts, self.experts.gate_up_proj, self.experts.down_proj,
                                        shared=shared, rows=rows)


class TopKMoe(nn.Module):
    """A softmax router and routed experts, no shared expert: `router.weight` [E, H], `experts.*`. renormalize: the
    k chosen weights sum to one (softmax over the top-k logits: Granite 4.0-H), else they are the full softmax's
    (Jamba)."""

    def __init__(self, cfg: ModelConfig, ops, renormalize: bool):
        super().__init__()
        self.ops = ops
        self.top_k, self.renormalize = cfg.params.num_experts_per_tok, renormalize
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x):
        w, e = self.ops.route(x, self.router.weight, self.top_k, self.renormalize)
        return self.ops.experts_forward(x, w, e, self.experts.gate_up_proj, self.experts.down_proj)
