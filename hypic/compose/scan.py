"""The chain of affine maps of a request's pieces, for all requests of a batch at once.

A request's linear state goes through its pieces in order; every piece is an affine map of the
state, state <- T_j state + S_j (a cached segment, or a run's zero-start summary). The compose
pass needs the state *before* each map (the initial state of each run) and the state after the
last. `scan_chain` is the plain version (one compose per map); `scan_dense` folds the chains of
dense transitions of every request in one Triton kernel on CUDA (one program per request, value
head and block of value columns, the state block in registers, fp32 IEEE products).
"""

from __future__ import annotations

import torch

from .transition import Form, Transition, compose

# the Triton scan's step table (ops/triton_scan.py `scan_steps`), its kind column (2): bit 0 set for a run's map (else a
# cached segment's); STEP_FROM_ZERO set on a chain's first step only where the state entering it is zero (the chain's
# init must be), so the step is x <- S: the product T 0 and a run's correction (+ 0) are left out, the result the same
# to the bit (a compose pass without a cached prefix: one step of ~20 a layer on the 35B benchmark's request)
STEP_FROM_ZERO = 2
# STEP_BY_POSITION set on a chain's first row: every step after it is a run's dense map (the low-rank pairs' buffer, its
# [c | M] rows) at consecutive slots from the next row's, so the scan reads step j's map at a position it computes, not
# through the row's offset: the loads no longer wait on the row's, and Triton's pipeliner keeps two maps in flight (ops/
# triton_scan.py `_by_position`)
STEP_BY_POSITION = 4


def scan_chain(init: torch.Tensor, maps: list, *, exact: list[bool] | None = None):
    """init [H, K, V]; maps [(Transition, S)]. Returns (states before each map, final state)."""
    before, state = [], init
    for j, (t, s) in enumerate(maps):
        before.append(state)
        state = compose(state, t, s, exact=True if exact is None else exact[j])
    return before, state


def scan_dense_reference(init: torch.Tensor, T: torch.Tensor, S: torch.Tensor, cu, order=None, runs=None):
    """init [R, H, K, V], T [M, H, K, K], S [M, H, K, V], cu [R + 1] (maps of request r: cu[r]..cu[r+1]).
    order (optional): map j of the chains is storage slot order[j] of T, S and before.
    runs [N, H, K, V + K] (optional): slots M .. M + N - 1 are these runs' [S | T].
    Returns (before [slots, H, K, V], final [R, H, K, V]), fp32."""
    if runs is not None:
        v = S.shape[-1]
        T, S = torch.cat([T.float(), runs[..., v:].float()]), torch.cat([S.float(), runs[..., :v].float()])
    before = torch.empty_like(S, dtype=torch.float32)
    final = torch.empty_like(init, dtype=torch.float32)
    cu = cu.tolist() if torch.is_tensor(cu) else cu
    order = order.tolist() if torch.is_tensor(order) else order
    for r in range(len(cu) - 1):
        state = init[r].float()
        for j in range(cu[r], cu[r + 1]):
            s = j if order is None else order[j]
            before[s] = state
            state = T[s].float() @ state + S[s].float()
        final[r] = state
    return before, final


def scan_dense(init, T, S, cu, order=None, runs=None, runs_only: bool = False):
    """The same on CUDA in one kernel launch (the reference elsewhere). cu: a list, or an int32 device
    tensor (read by the kernel: no host copy, CUDA-graph safe), as is order; runs are read in place.
    runs_only: only the runs' slots of `before` are needed (the kernel leaves the others unwritten)."""
    from ..ops.fast import needs_grad

    if not init.is_cuda or _kernel() is None or needs_grad(init, T, S, runs):    # (the kernel has no backward)
        return scan_dense_reference(init, T, S, cu, order, runs)
    return _kernel()(init, T, S, cu, order=order, runs=runs, runs_only=runs_only)


def scan_steps(init, steps, cu, runs, slots: int, outputs=None, max_run: int = 16, factors=None):
    """The compose pass's form on CUDA (ops/triton_scan.scan_steps): each chain step's T and S named by
    address in a step table, runs' [S | T] in place (or their S, with their transitions as `factors`:
    reference `run_factors`); `before` written at the runs' slots only, or, given the run summaries'
    outputs, those corrected in place to the runs' true initial states. Needs the Triton kernel
    (`kernel_ready`)."""
    from ..ops.fast import triton_kernel

    return triton_kernel("steps")(init, steps, cu, runs, slots, outputs=outputs, max_run=max_run, factors=factors)


def kernel_ready(device) -> bool:
    """The step-table scan runs on this device (CUDA, triton importable, the kernel not failed to build)."""
    from ..ops.fast import triton_kernel

    return torch.device(device).type == "cuda" and triton_kernel("steps") is not None


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        try:
            from ..ops import triton_scan
        except Exception:  # no triton on this machine
            _KERNEL = False
        else:
            _KERNEL = triton_scan.scan_dense
    return _KERNEL or None


def stack_dense(maps: list) -> tuple[torch.Tensor, torch.Tensor]:
    """[(Transition dense, S)] -> (T [M, H, K, K], S [M, H, K, V]) fp32, one copy each."""
    return torch.stack([t.t.float() for t, _ in maps]), torch.stack([s.float() for _, s in maps])


__all__ = ["scan_chain", "scan_dense", "scan_steps", "scan_dense_reference", "kernel_ready", "stack_dense",
           "Form", "Transition"]
