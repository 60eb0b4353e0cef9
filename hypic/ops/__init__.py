"""Op backends behind one set of signatures (see ops/reference for the layouts).

    reference   pure PyTorch, any device: the ground truth
    fast        batched kernels with the same signatures: fla-core's Triton kernels on CUDA, SDPA,
                grouped-GEMM MoE, one varlen conv (ops/fast.py); falls back to the reference where
                a kernel cannot run (fla on CPU)
    auto        "fast"
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError


@dataclass(frozen=True)
class Backend:
    name: str
    chunk_gated_delta_rule: Callable
    recurrent_gated_delta_rule: Callable
    chunk_kda: Callable
    recurrent_kda: Callable
    chunk_gla: Callable
    recurrent_gla: Callable
    chunk_simple_gla: Callable
    recurrent_simple_gla: Callable
    causal_conv1d: Callable
    causal_conv1d_varlen: Callable
    position_attention: Callable
    decode_attention: Callable
    order_keys: Callable
    route: Callable
    route_grouped_sigmoid: Callable
    experts_forward: Callable
    experts_forward_plain: Callable
    recurrent_gated_delta_summary: Callable
    chunk_gated_delta_transition: Callable
    chunk_gated_delta_isolated: Callable
    rms_norm: Callable
    rms_norm_gated: Callable
    rms_norm_rope: Callable
    add_rms_norm: Callable
    gdn_gate: Callable
    gdn_gate_beta: Callable
    act_mul: Callable
    chunk_diagonal_scan: Callable
    recurrent_diagonal_scan: Callable
    gated_delta_tail: Callable


_REGISTRY = {"reference": "hypic.ops.reference", "fast": "hypic.ops.fast"}
_ALIASES = {"auto": "fast"}
_LOADED: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ConfigError(f"unknown op backend {name!r}; available: {sorted(_REGISTRY) + sorted(_ALIASES)}")
    if name not in _LOADED:
        m = importlib.import_module(_REGISTRY[name])
        _LOADED[name] = Backend(
            name, m.chunk_gated_delta_rule, m.recurrent_gated_delta_rule, m.chunk_kda, m.recurrent_kda, m.chunk_gla,
            m.recurrent_gla, m.chunk_simple_gla, m.recurrent_simple_gla, m.causal_conv1d, m.causal_conv1d_varlen,
            m.position_attention, m.decode_attention, m.order_keys, m.route, m.route_grouped_sigmoid, m.experts_forward,
            m.experts_forward_plain, m.recurrent_gated_delta_summary, m.chunk_gated_delta_transition, m.chunk_gated_delta_isolated,
            m.rms_norm, m.rms_norm_gated, m.rms_norm_rope, m.add_rms_norm, m.gdn_gate, m.gdn_gate_beta, m.act_mul, m.chunk_diagonal_scan, m.recurrent_diagonal_scan,
            m.gated_delta_tail,
        )
    return _LOADED[name]
