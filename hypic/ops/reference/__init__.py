"""Pure PyTorch reference ops: the ground truth every fast kernel is tested against."""

from .attention import decode_attention, order_keys, position_attention
from .conv import causal_conv1d, causal_conv1d_varlen
from .diagonal import chunk_diagonal_scan, recurrent_diagonal_scan
from .gated_delta import chunk_gated_delta_isolated, chunk_gated_delta_rule, chunk_gated_delta_transition, gated_delta_tail, l2norm, recurrent_gated_delta_rule, recurrent_gated_delta_summary
from .gla import chunk_gla, chunk_simple_gla, recurrent_gla, recurrent_simple_gla
from .kda import chunk_kda, recurrent_kda
from .moe import (clamped_swiglu, experts_forward, experts_forward_plain, pad_weights, route, route_grouped_sigmoid,
                  with_shared)
from .norm import act_mul, add_rms_norm, gdn_gate, gdn_gate_beta, rms_norm, rms_norm_gated, rms_norm_rope

__all__ = [
    "causal_conv1d", "causal_conv1d_varlen", "gated_delta_tail", "chunk_diagonal_scan", "recurrent_diagonal_scan", "decode_attention", "chunk_gated_delta_rule", "chunk_gated_delta_transition",
    "chunk_gated_delta_isolated", "chunk_gla", "chunk_kda", "chunk_simple_gla", "recurrent_gla",
    "recurrent_kda", "recurrent_simple_gla", "clamped_swiglu", "experts_forward", "experts_forward_plain", "l2norm",
    "order_keys", "position_attention", "rms_norm", "rms_norm_gated", "rms_norm_rope", "add_rms_norm", "gdn_gate", "gdn_gate_beta", "act_mul", "recurrent_gated_delta_rule", "recurrent_gated_delta_summary", "route", "route_grouped_sigmoid",
    "with_shared", "pad_weights",
]
