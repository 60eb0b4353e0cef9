"""Rotary position embedding (rotate-half layout, partial: only the first `rotary_dim` dims).

Text-only Qwen3.5 uses interleaved M-RoPE with identical temporal/height/width positions, which
reduces to this plain RoPE. Frequencies of non-default RoPE types come from transformers'
own ROPE_INIT_FUNCTIONS.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedArchitectureError
from ..ops.reference.attention import rope_into


def inverse_frequencies(cfg: ModelConfig, rotary_dim: int, rope: dict, layer_type: str | None = None
                        ) -> tuple[torch.Tensor, float]:
    """layer_type: a model with RoPE parameters per layer type (LFM3) names the type; transformers' init reads them
    from there."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = rope.get("rope_theta", 10000.0)
        d = rotary_dim
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float(), 1.0
    if rope_type == "dynamic":
        raise UnsupportedArchitectureError("dynamic RoPE depends on the sequence length; not position independent")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedArchitectureError(f"unsupported rope_type {rope_type!r}")
    hf = cfg.hf_config()
    inv, scaling = (ROPE_INIT_FUNCTIONS[rope_type](hf, None) if layer_type is None
                    else ROPE_INIT_FUNCTIONS[rope_type](hf, None, layer_type=layer_type))
    return inv.float(), float(scaling)


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_dim: int, rope: dict, layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):            # real numbers even when the modules are built on "meta"
            inv, self.scaling = inverse_frequencies(cfg, rotary_dim, rope, layer_type)
        self.inv_freq = inv          # fp32 always: a plain attribute, so model.to(dtype) leaves it alone
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [N] -> cos, sin [N, rotary_dim] (fp32 angles, cast to dtype)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, D]; rotates the first rotary_dim dims of every head. (Differentiable: the PIC trainer runs it
        under autograd, which apply_into's out= products do not support.)"""
        r = self.rotary_dim
        xr, xp = x[..., :r], x[..., r:]
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        rot = torch.cat([-x2, x1], dim=-1)
        out = xr * cos[:, None, :] + rot * sin[:, None, :]
        return torch.cat([out, xp], dim=-1)

    def apply_into(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
        """apply(x, cos, sin) written into out [N, H, D] (another tensor, e.g. a slice of the compose pass's keys
        buffer; no autograd), with no rotated or concatenated copy in between. The same products and sums in the
        same roundings as apply's rotate-half form (x1 cos - x2 sin is x1 cos + (-x2) sin exactly; cos and sin
        repeat their first half): equal to it bit for bit (tests/test_compose_graph.py)."""
        rope_into(x, cos, sin, out, self.rotary_dim)
