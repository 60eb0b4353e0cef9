"""Griffin's recurrent block with the RG-LRU (Real-Gated Linear Recurrent Unit), as RecurrentGemma uses it.

    y = act(linear_y(x))                       the output gate branch
    c = conv_1d(linear_x(x))                   a depthwise causal conv (bias, no activation) over D = lru_width
    i_t = sigmoid(c_t W_i + b_i), r_t = sigmoid(c_t W_a + b_a)       block-diagonal gates: H blocks of D / H channels
    log a_t = -8 r_t softplus(Lambda)          per channel
    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * c_t)
    out = linear_out(h * y)
The recurrence is elementwise, so the state is a D-vector and a segment's T is diagonal: exp(sum_t log a_t) per
channel. In the [H, K, V] layout every channel is a head with K = V = 1 (T stored as [D, 1]).

Position 0: RecurrentGemma treats the token at absolute position 0 as a sequence start ("reset"): its input is not
normalised (multiplier 1) and its a is zeroed. The state before position 0 is always zero (a request's first token),
so zeroing a there changes nothing and is not done: the kernel's transition stays exp(sum log a) for every run, and
the composition algebra holds for any initial state. Only the multiplier depends on the position, taken from the
batch's positions: an isolated prefill runs a segment at positions 0..L-1, so its entry is the segment read as a
document start (as a segment placed first in a request with no prefix reads it in `full` mode: invariant 3 holds
whatever the seam); placed later, its seam tokens are recomputed at their true positions, without the reset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compose.transition import Form, log_decay_transitions
from ..config import ModelConfig
from .linear import LinearMixer
from .mlp import activation


class RGLRUParams(nn.Module):
    """The RG-LRU's parameters under transformers' names (`rg_lru.*`)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        bw = width // heads
        self.recurrent_param = nn.Parameter(torch.zeros(width))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, bw, bw))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(heads, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(heads, bw))


class RGLRUMixer(LinearMixer):
    form = Form.DIAGONAL
    conv_activation = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p = cfg.params
        hs, self.width, self.heads = cfg.hidden_size, p.lru_width, p.num_attention_heads
        self.conv_width = p.conv1d_width
        self.linear_y = nn.Linear(hs, self.width)
        self.linear_x = nn.Linear(hs, self.width)
        self.linear_out = nn.Linear(self.width, hs)
        self.conv_1d = nn.Conv1d(self.width, self.width, self.conv_width, groups=self.width,
                                 padding=self.conv_width - 1)
        self.rg_lru = RGLRUParams(self.width, self.heads)
        self.act = activation(p.hidden_activation)

    @property
    def state_shape(self):
        return self.width, 1, 1

    @property
    def conv_dim(self) -> int:
        return self.width

    def conv_weights(self):
        return self.conv_1d.weight.squeeze(1), self.conv_1d.bias

    def features(self, x, batch):
        return {"raw": self.linear_x(x), "y": self.act(self.linear_y(x)), "reset": batch.positions == 0}

    def gates(self, c: torch.Tensor):
        """conv outputs c [n, D] -> (input gate, log a) [n, D] fp32: block-diagonal gates (c W + b per head)."""
        r = self.rg_lru
        n, bw = c.shape[0], self.width // self.heads
        blocks = c.float().view(n, self.heads, bw)
        gate_i = torch.sigmoid(torch.einsum("nhi,hij->nhj", blocks, r.input_gate_weight.float())
                               + r.input_gate_bias.float()).reshape(n, self.width)
        gate_a = torch.sigmoid(torch.einsum("nhi,hij->nhj", blocks, r.recurrent_gate_weight.float())
                               + r.recurrent_gate_bias.float()).reshape(n, self.width)
        return gate_i, -8.0 * gate_a * F.softplus(r.recurrent_param.float())

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        gate_i, log_a = self.gates(conv_out)
        # sqrt(1 - a^2), written as sqrt(-expm1(2 log a)) (exact where a is close to 1); 1 at position 0
        mult = torch.sqrt(-torch.expm1(2.0 * log_a))
        mult = torch.where(f["reset"][idx][:, None], torch.ones_like(mult), mult)
        u = conv_out.float() * gate_i * mult
        fn = (self.ops.recurrent_diagonal_scan if int((cu[1:] - cu[:-1]).max()) == 1
              else self.ops.chunk_diagonal_scan)
        o, final = fn(u[None], log_a[None], initial_state=init.reshape(init.shape[0], self.width),
                      output_final_state=True, cu_seqlens=cu)
        ts = log_decay_transitions(log_a[:, :, None], cu, Form.DIAGONAL) if summarize else None
        return o[0], final.view(-1, self.width, 1, 1), ts

    def output(self, x, o, f):
        return self.linear_out(o.to(x.dtype) * f["y"])
