"""LFM2's gated short convolution: y = out_proj(C * conv(B * x)), with B, C, x = in_proj(h) split in
three and a depthwise causal conv of width W (`conv_L_cache`) without activation.

The layer has no recurrent state: what one token sees of the past is the last W-1 conv inputs. In
the `LinearMixer` frame it is a family with an empty state (H = 0, so T and S are zero-size and
cost nothing) whose PIC is the conv warm-up alone: a cached segment hands on its conv tail, and a
seam of w >= W-1 tokens makes the cached tokens' conv inputs exactly their isolated ones.
"""

from __future__ import annotations

from torch import nn

from ..compose.transition import Form, Transition
from ..config import ModelConfig
from .linear import LinearMixer


class ConvOnlyMixer(LinearMixer):
    """A mixer whose whole context is its conv window: no recurrent state (T and S zero-size), the conv's output is
    the kernel's. A subclass writes features (its "raw" conv input), output and its conv weights."""

    form = Form.SCALAR
    conv_activation = None

    @property
    def state_shape(self):
        return 0, 1, 1                                              # no recurrent state

    def kernel(self, f, conv_out, idx, init, cu, summarize):
        ts = [Transition(Form.SCALAR, init.new_zeros(0)) for _ in range(len(cu) - 1)] if summarize else None
        return conv_out, init, ts


class ShortConv(ConvOnlyMixer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p, hs = cfg.params, cfg.hidden_size
        self.hidden = hs
        self.conv_width = p.conv_kernel
        self.conv = nn.Conv1d(hs, hs, kernel_size=p.conv_kernel, groups=hs, bias=p.conv_bias,
                              padding=p.conv_kernel - 1)           # transformers' module: [C, 1, W]
        self.in_proj = nn.Linear(hs, 3 * hs, bias=p.conv_bias)
        self.out_proj = nn.Linear(hs, hs, bias=p.conv_bias)

    @property
    def conv_dim(self) -> int:
        return self.hidden

    def conv_weights(self):
        return self.conv.weight.squeeze(1), self.conv.bias

    def features(self, x, batch):
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        return {"raw": b * xx, "C": c}

    def output(self, x, o, f):
        return self.out_proj(f["C"] * o.to(x.dtype))
