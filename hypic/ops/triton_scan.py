"""Triton kernel: the chains of dense affine maps of many requests in one launch (CUDA only).

Program (request r, value head h, value block b) holds its state block X [K, BV] (fp32) and walks
the request's maps j = cu[r] .. cu[r+1]-1: it writes X to before[j], then X <- T_j X + S_j, with
fp32-accurate products (plain tf32 would cost ~3e-4 relative per map, and chains compound it). The state
never leaves registers between maps; T_j is read once per value block. Products in "tf32x3" (three
tf32 tensor-core products, fp32-level accuracy: 1.6e-6 relative after 20 maps of K = 128 on the H200,
against 5.8e-7 for IEEE FMA, which ran 70x slower: benchmarks/results/gpu_check.json).

Imported lazily (compose/scan.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scan_kernel(init, T, S, A, before, final, cu, order, E, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ORDER: tl.constexpr, RUNS: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m_kv = mk[:, None] & mv[None, :]
    m_kk = mk[:, None] & mk[None, :]
    off_kv = rk[:, None] * V + rv[None, :]
    off_kk = rk[:, None] * K + rk[None, :]
    off_a_s = rk[:, None] * (V + K) + rv[None, :]          # A [R, H, K, V + K] = [S | T] of the runs
    off_a_t = rk[:, None] * (V + K) + V + rk[None, :]
    x = tl.load(init + (r * H + h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
    j0 = tl.load(cu + r)
    j1 = tl.load(cu + r + 1)
    j = j0
    while j < j1:
        if ORDER:
            m = tl.load(order + j)
        else:
            m = j
        tl.store(before + (m * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv)
        if RUNS and m >= E:
            base_a = ((m - E) * H + h).to(tl.int64) * K * (V + K)
            t = tl.load(A + base_a + off_a_t, mask=m_kk, other=0.0)
            s = tl.load(A + base_a + off_a_s, mask=m_kv, other=0.0)
        else:
            t = tl.load(T + (m * H + h).to(tl.int64) * K * K + off_kk, mask=m_kk, other=0.0)
            s = tl.load(S + (m * H + h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0)
        x = tl.dot(t, x, input_precision=PREC) + s
        j += 1
    tl.store(final + (r * H + h).to(tl.int64) * K * V + off_kv, x, mask=m_kv)


_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:                      # (Triton's interpreter runs on the CPU: count a full H200)
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _SMS[device]


def scan_dense(init: torch.Tensor, T: torch.Tensor, S: torch.Tensor, cu, *, order=None, runs=None,
               bv: int | None = None, warps: int | None = None, precision: str = "tf32x3"):
    """init [R, H, K, V], T [M, H, K, K], S [M, H, K, V] (fp32), cu [R + 1] -> (before, final [R, H, K, V]).
    cu: a list or an int32 device tensor; order [M'] int32 (device, optional): map j is slot order[j].
    runs [N, H, K, V + K] (optional, fp32 contiguous): slots M .. M + N - 1 are these runs' [S | T] (the
    appended-identity kernel's final states), read in place; before then has M + N slots."""
    r, h, k, v = init.shape
    init, T, S = init.float().contiguous(), T.float().contiguous(), S.float().contiguous()
    e = T.shape[0]
    slots = e + (0 if runs is None else runs.shape[0])
    before = S.new_empty((slots,) + tuple(S.shape[1:]))
    final = torch.empty_like(init)
    if slots == 0:
        final.copy_(init)
        return before, final
    if runs is not None and not (runs.is_contiguous() and runs.dtype == torch.float32 and runs.shape[-1] == v + k):
        raise ValueError("runs must be fp32, contiguous, [N, H, K, V + K]")
    bk = max(16, triton.next_power_of_2(k))
    if bv is None:
        # one program per (request, head, block of 64 value columns); with too few of them to fill half the
        # SMs (one request: 1 x 32 heads x 2 blocks = 64 programs on 132 SMs) blocks of 32 double the
        # programs at the cost of reading each T twice (run 3 / 5: 64 was faster with 3 requests = 96)
        bv = 32 if r * h * triton.cdiv(v, 64) < _sm_count(init.device) // 2 else 64
    cu_t = cu if torch.is_tensor(cu) else torch.tensor(cu, dtype=torch.int32).to(init.device, non_blocking=True)
    grid = (r, h, triton.cdiv(v, bv))
    _scan_kernel[grid](init, T, S, S if runs is None else runs, before, final, cu_t, cu_t if order is None else order,
                       e, H=h, K=k, V=v, BK=bk, BV=bv, PREC=precision, ORDER=order is not None,
                       RUNS=runs is not None, num_warps=warps or 8)
    return before, final
