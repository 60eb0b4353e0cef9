"""Pure PyTorch reference ops: the ground truth every fast kernel is tested against."""

from .attention import position_attention
from .conv import causal_conv1d
from .gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from .moe import experts_forward, route

__all__ = [
    "causal_conv1d", "chunk_gated_delta_rule", "experts_forward", "l2norm",
    "position_attention", "recurrent_gated_delta_rule", "route",
]
