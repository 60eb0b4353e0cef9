"""Segment transition operators in their three forms, and the affine composition of states.

Every linear-attention recurrence hypic serves is affine in its incoming state. For a segment C
processed from S_in (state layout [H, K, V], the recurrence acting on the key axis K):

    S_out = T(C) S_in + S(C|0)

The form of T is a property of the family, and it sets both the arithmetic and the storage:

    form      families                              A_t                          T stored as
    SCALAR    Mamba2, lightning / MiniMax, RetNet   exp(g_t) I                   [H]       exp(sum g)
    DIAGONAL  GLA, Mamba1 (per channel)             diag(exp(gk_t))              [H, K]    exp(sum gk)
    DENSE     DeltaNet, Gated DeltaNet, KDA         exp(g)(I - b k k^T)(diag)    [H, K, K] A_n ... A_1

T and composed states are fp32: with slow decays T sits near 1, where bf16 spacing (2^-8) would
round a decay of 0.999 to 1, and composition multiplies many T's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Form(str, enum.Enum):
    SCALAR = "scalar"
    DIAGONAL = "diagonal"
    DENSE = "dense"


@dataclass(frozen=True)
class Transition:
    """T(C) of one segment for every head. `t` is [H] (scalar), [H, K] (diagonal) or [H, K, K] (dense)."""

    form: Form
    t: torch.Tensor

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """T @ state for state [..., H, K, V] (the key axis is the one T acts on)."""
        if self.form is Form.SCALAR:
            return self.t[:, None, None] * state
        if self.form is Form.DIAGONAL:
            return self.t[..., None] * state
        return self.t @ state

    def then(self, later: "Transition") -> "Transition":
        """The transition of this segment followed by `later`: T_later @ T_self."""
        if self.form is not later.form:
            raise ValueError(f"cannot chain a {self.form.value} and a {later.form.value} transition")
        t = later.t @ self.t if self.form is Form.DENSE else later.t * self.t
        return Transition(self.form, t)

    def rotated(self, rot: torch.Tensor) -> "Transition":
        """R T R^T for an orthogonal key-axis rotation rot [K, K] (RoPE'd keys). Scalar T commutes with
        any rotation; a diagonal T commutes only with a rotation whose 2-planes share a decay."""
        if self.form is Form.SCALAR:
            return self
        t = self.t if self.form is Form.DENSE else torch.diag_embed(self.t)
        return Transition(Form.DENSE, rot @ t @ rot.transpose(-1, -2))

    @property
    def nbytes(self) -> int:
        return self.t.element_size() * self.t.nelement()

    @staticmethod
    def identity(form: Form, h: int, k: int, device=None) -> "Transition":
        if form is Form.SCALAR:
            return Transition(form, torch.ones(h, device=device))
        if form is Form.DIAGONAL:
            return Transition(form, torch.ones(h, k, device=device))
        return Transition(form, torch.eye(k, device=device).expand(h, k, k).clone())


def compose(state: torch.Tensor, t: Transition, s: torch.Tensor, *, exact: bool = True) -> torch.Tensor:
    """state <- T @ state + S (exact), or state + S (naive addition, the straw man)."""
    return (t.apply(state) if exact else state) + s


def compose_chain(state: torch.Tensor, summaries, *, exact: bool = True) -> torch.Tensor:
    """Fold a sequence of (Transition, S) pairs into a state, left to right."""
    for t, s in summaries:
        state = compose(state, t, s, exact=exact)
    return state


def zero_start(final: torch.Tensor, t: Transition, init: torch.Tensor) -> torch.Tensor:
    """S(C|0) = S_out - T @ S_in: the zero-start state of a run that started from `init`
    (exact in algebra; rounding only when init != 0)."""
    return final - t.apply(init)


def log_decay_transitions(log_decay: torch.Tensor, cu_seqlens: torch.Tensor, form: Form) -> list[Transition]:
    """Scalar / diagonal T of each varlen run from per-token log decays.

    log_decay: [N_tokens, H] (scalar) or [N_tokens, H, K] (diagonal), fp32; cu_seqlens [R + 1].
    T = exp(sum over the run of log decay): the product of the per-token decays.
    """
    csum = torch.cat([log_decay.new_zeros((1,) + log_decay.shape[1:]), log_decay.float().cumsum(0)])
    cu = cu_seqlens.tolist()
    return [Transition(form, (csum[b] - csum[a]).exp()) for a, b in zip(cu[:-1], cu[1:])]


# -- dense T: the appended-identity trick -------------------------------------------------------
def augment(v: torch.Tensor, init: torch.Tensor, k_dim: int):
    """v [..., H, V] -> [..., H, V + K] (zeros appended); init [N, H, K, V] -> [N, H, K, V + K] = [init | I].

    The recurrence acts on every value column alone, and the K zero-valued columns receive no
    writes, so they evolve as X_t = A_t X_{t-1} from X_0 = I: the final state is [S_out | T]."""
    v_aug = torch.cat([v, v.new_zeros(v.shape[:-1] + (k_dim,))], dim=-1)
    eye = torch.eye(k_dim, dtype=init.dtype, device=init.device).expand(init.shape[0], init.shape[1], k_dim, k_dim)
    return v_aug, torch.cat([init, eye], dim=-1)


def split_augmented(final_aug: torch.Tensor, v_dim: int, own: bool = True):
    """final [N, H, K, V + K] -> (S_out [N, H, K, V], [Transition] per sequence).

    own: each T gets its own memory (entries are cached one by one, and a view would pin the whole
    batch); False: views, for a caller that clones only what it caches."""
    s_out, t = final_aug[..., :v_dim], final_aug[..., v_dim:]
    return s_out, [Transition(Form.DENSE, t[i].clone() if own else t[i]) for i in range(t.shape[0])]
