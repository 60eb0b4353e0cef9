"""Composition algebra of linear-attention states (dense transitions: DeltaNet / Gated DeltaNet).

A segment C processed from state S_in gives S_out = T(C) @ S_in + S(C|0), with
    T(C)    [HV, K, K] fp32   the product of the per-token transitions (acts on the key axis)
    S(C|0)  [HV, K, V] fp32   the end state from a zero start
The recurrence acts on each value column independently, so one pass with K extra value columns
computes both:  v' = [v | 0_K],  initial state [S_in | I_K]  ->  final state [S_out | T].
Then S(C|0) = S_out - T @ S_in (exact when S_in = 0).
"""

from __future__ import annotations

import torch


def augment(v: torch.Tensor, init: torch.Tensor, k_dim: int):
    """v [..., HV, V] -> [..., HV, V + K] (zeros appended); init [N, HV, K, V] -> [N, HV, K, V + K] = [init | I]."""
    v_aug = torch.cat([v, v.new_zeros(v.shape[:-1] + (k_dim,))], dim=-1)
    eye = torch.eye(k_dim, dtype=init.dtype, device=init.device).expand(init.shape[0], init.shape[1], k_dim, k_dim)
    return v_aug, torch.cat([init, eye], dim=-1)


def split_summary(final_aug: torch.Tensor, init: torch.Tensor, v_dim: int):
    """final [N, HV, K, V + K] -> (S_out, T, S(C|0)); S(C|0) = S_out - T @ init."""
    s_out, t = final_aug[..., :v_dim], final_aug[..., v_dim:]
    return s_out, t, s_out - t @ init


def compose(state: torch.Tensor, t: torch.Tensor, s: torch.Tensor, *, exact: bool = True) -> torch.Tensor:
    """state <- T @ state + S (exact), or state + S (naive addition, the straw man)."""
    return (t @ state if exact else state) + s


def compose_chain(state: torch.Tensor, summaries, *, exact: bool = True) -> torch.Tensor:
    """Fold a sequence of (T, S) pairs into a state, left to right."""
    for t, s in summaries:
        state = compose(state, t, s, exact=exact)
    return state
