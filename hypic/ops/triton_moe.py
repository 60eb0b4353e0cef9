"""Triton kernels: the routed experts of a MoE layer for few tokens per expert (CUDA only).

A warm `pic` request sends a few hundred tokens through each MoE layer (seam windows, the query); with
top-8 of 256 experts that is ~8 rows per expert, and decode has fewer. The layer then costs what it
takes to read every expert's weights once (1.6 GB per layer on Qwen3.5-35B-A3B). torch._grouped_mm's
kernels are made for many rows per expert: on the H200 they read the weights at ~72% of the copy rate
in the warm request (run 31: 21.3 ms for 64.4 GB). Here each program streams one tile of one expert's
weight rows through its K loop, with the expert's few token rows as the narrow side of the product
(weights [BN, BK] x tokens^T [BK, BM]); the token rows are gathered by index inside the kernel:

    gate_up   program (expert e, column block nb): acc_g, acc_u [BN, BM] over H; h = silu(g) * u
              written in sorted order (bf16 rows [n*k, I])
    down      program (expert e, column block nb): acc [BN, BM] over I, times each row's routing
              weight, written at the row's own place (token t, choice j) -> ys [n, k, H]
    combine   program (token t, column block): its k rows summed in fp32 in a fixed order (no atomics),
              plus a shared expert's output times the sigmoid of its gate where the layer has one,
              rounded once to the output dtype (two to five PyTorch launches per layer before)

An expert with more than BM rows takes several passes over its weight tile (the second from L2). The
tile sizes, warps and pipeline depth are picked per shape by timing a few configurations on the first
eager call (not while a CUDA graph is captured). Imported lazily (ops/fast.py): needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference.moe import with_shared
from .tuning import descriptors_fit, tuned_config

# the experts' weight tiles read by tensor descriptors (TMA on sm_90+: one bulk copy per tile instead of the
# threads' own address arithmetic and 16-byte loads) where the weights allow it (rows of a multiple of 16 bytes);
# False: by pointers, as before the thirty-second session (benchmarks/moe_bench.py times both). H100 run 109, paired on
# the warm request (gpu_bench's `moe_tma`): +0.04 ms (the pointer form already at ~93% of the copy rate): off
TMA_WEIGHTS = False

# (a persistent form of both kernels, each program walking its tiles' K steps as one pipelined loop, was measured and
# removed: H100 run 109, paired on the warm request, +1.60 ms; code at git c02740f)

# the combine by one kernel (twenty-ninth session); False: a sum over the k rows, a cast, and the shared expert's
# sigmoid, product and sum by PyTorch ops (gpu_bench's variant moe_combine_by_torch)
COMBINE_KERNEL = True


@triton.jit
def _rows(order, m0, r1, BM: tl.constexpr, TOPK: tl.constexpr):
    rows = m0 + tl.arange(0, BM)
    mr = rows < r1
    a = tl.load(order + rows, mask=mr, other=0)           # the row's (token, choice) index t * k + j
    return rows, mr, a, a // TOPK


@triton.jit
def _expert_rows(offs, e):
    """Expert e's rows r0 .. r1 - 1 of the sorted layout (offs: inclusive cumulative counts)."""
    r1 = tl.load(offs + e)
    r0 = tl.load(offs + e - 1, mask=e > 0, other=0)
    return r0, r1


@triton.jit
def _gate_up_rows(x, order, w, h, e, nb, m0, r1, s_x, s_we, s_wn, s_h, H: tl.constexpr, I: tl.constexpr,
                  TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                  PREC: tl.constexpr, DESC: tl.constexpr):
    """Sorted rows m0 .. min(m0 + BM, r1) - 1 (expert e's) through the gate and up rows of column block nb, one pass
    over H: h = silu(x W_g^T) * (x W_u^T) on those rows and columns.
    DESC: w is a tensor descriptor of the weights as [E * 2I, H] (TMA loads of [BN, BK] tiles; rows past the
    expert's gate or up rows are read but never stored: `mn`), else a pointer."""
    rk = tl.arange(0, BK)
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < I
    g_row = e * (2 * I) + nb * BN
    if not DESC:
        wg = w + e.to(tl.int64) * s_we + rn[:, None].to(tl.int64) * s_wn + rk[None, :]   # gate rows
        wu = wg + I * s_wn                                                             # up rows
    rows, mr, a, tok = _rows(order, m0, r1, BM, TOPK)
    xp = x + tok[None, :].to(tl.int64) * s_x + rk[:, None]                             # x^T [BK, BM]
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(0, H, BK, num_stages=STAGES):
        mk = (k0 + rk) < H
        xt = tl.load(xp + k0, mask=mk[:, None] & mr[None, :], other=0.0)
        if DESC:
            g = w.load([g_row, k0])
            u = w.load([g_row + I, k0])
        else:
            g = tl.load(wg + k0, mask=mn[:, None] & mk[None, :], other=0.0)
            u = tl.load(wu + k0, mask=mn[:, None] & mk[None, :], other=0.0)
        acc_g = tl.dot(g, xt, acc_g, input_precision=PREC)
        acc_u = tl.dot(u, xt, acc_u, input_precision=PREC)
    y = acc_g * tl.sigmoid(acc_g) * acc_u                                              # silu(g) * u, fp32
    tl.store(h + rows[None, :].to(tl.int64) * s_h + rn[:, None], y.to(h.dtype.element_ty),
             mask=mn[:, None] & mr[None, :])


@triton.jit
def _down_rows(h, order, wts, w, ys, e, nb, m0, r1, s_h, s_we, s_wn, s_y, H: tl.constexpr, I: tl.constexpr,
               TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               PREC: tl.constexpr, DESC: tl.constexpr):
    """Sorted rows m0 .. min(m0 + BM, r1) - 1 (expert e's) through the down rows of column block nb, one pass over I,
    each row times its routing weight, written at its (token, choice) place in ys. DESC: w a descriptor of [E * H, I]."""
    rk = tl.arange(0, BK)
    rn = nb * BN + tl.arange(0, BN)
    mn = rn < H
    d_row = e * H + nb * BN
    if not DESC:
        wp = w + e.to(tl.int64) * s_we + rn[:, None].to(tl.int64) * s_wn + rk[None, :]   # down rows [BN, BK]
    rows, mr, a, tok = _rows(order, m0, r1, BM, TOPK)
    hp = h + rows[None, :].to(tl.int64) * s_h + rk[:, None]                              # h^T [BK, BM]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(0, I, BK, num_stages=STAGES):
        mk = (k0 + rk) < I
        ht = tl.load(hp + k0, mask=mk[:, None] & mr[None, :], other=0.0)
        if DESC:
            d = w.load([d_row, k0])
        else:
            d = tl.load(wp + k0, mask=mn[:, None] & mk[None, :], other=0.0)
        acc = tl.dot(d, ht, acc, input_precision=PREC)
    wt = tl.load(wts + a, mask=mr, other=0.0).to(tl.float32)                             # routing weight
    acc = acc * wt[None, :]
    tl.store(ys + a[None, :].to(tl.int64) * s_y + rn[:, None], acc.to(ys.dtype.element_ty),
             mask=mn[:, None] & mr[None, :])


@triton.jit
def _gate_up_kernel(x, order, offs, w, h, s_x, s_we, s_wn, s_h, H: tl.constexpr, I: tl.constexpr,
                    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                    PREC: tl.constexpr, DESC: tl.constexpr = False):
    e = tl.program_id(0)
    r0, r1 = _expert_rows(offs, e)
    m0 = r0
    while m0 < r1:
        _gate_up_rows(x, order, w, h, e, tl.program_id(1), m0, r1, s_x, s_we, s_wn, s_h, H, I, TOPK, BM, BN, BK,
                      STAGES, PREC, DESC)
        m0 += BM


@triton.jit
def _down_kernel(h, order, offs, wts, w, ys, s_h, s_we, s_wn, s_y, H: tl.constexpr, I: tl.constexpr,
                 TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 PREC: tl.constexpr, DESC: tl.constexpr = False):
    e = tl.program_id(0)
    r0, r1 = _expert_rows(offs, e)
    m0 = r0
    while m0 < r1:
        _down_rows(h, order, wts, w, ys, e, tl.program_id(1), m0, r1, s_h, s_we, s_wn, s_y, H, I, TOPK, BM, BN, BK,
                   STAGES, PREC, DESC)
        m0 += BM


@triton.jit
def _combine_kernel(ys, sg, so, out, s_so, s_sg, real, H: tl.constexpr, TOPK: tl.constexpr, SHARED: tl.constexpr,
                    BH: tl.constexpr, REAL: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = cols < H
    if REAL:                    # a padding token's rows were never written (no expert took its choices): none read
        mr = m & (t < tl.load(real))
    else:
        mr = m
    row = ys + (t * TOPK).to(tl.int64) * H + cols
    acc = tl.zeros([BH], tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(row + j * H, mask=mr, other=0.0).to(tl.float32)
    if SHARED:
        g = tl.load(sg + t.to(tl.int64) * s_sg).to(tl.float32)
        acc += tl.sigmoid(g) * tl.load(so + t.to(tl.int64) * s_so + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + t.to(tl.int64) * H + cols, acc.to(out.dtype.element_ty), mask=m)


def combine(ys: torch.Tensor, k: int, shared=None, rows=None) -> torch.Tensor:
    """ys [n * k, H] (token t's k rows at t * k .. t * k + k - 1, each already times its routing weight) -> [n, H] in
    ys' dtype: each token's k rows summed in fp32, plus sigmoid(gate) * out of a shared expert (shared: (gate [n, 1],
    out [n, H]) or None), rounded once. rows ([1] int tensor or None): tokens from rows[0] on are padding: no routed
    row of theirs is read (their sum is the shared part alone)."""
    nk, hd = ys.shape
    n = nk // k
    ys = ys.contiguous()
    out = ys.new_empty((n, hd))
    if shared is not None:
        sg, so = shared
        if so.stride(-1) != 1:
            so = so.contiguous()
        args = (sg, so, so.stride(0), sg.stride(0))
    else:
        args = (ys, ys, 0, 0)
    bh = min(1024, triton.next_power_of_2(hd))
    if n:
        _combine_kernel[(n, triton.cdiv(hd, bh))](ys, args[0], args[1], out, args[2], args[3],
                                                 ys if rows is None else rows, H=hd, TOPK=k,
                                                 SHARED=shared is not None, BH=bh, REAL=rows is not None, num_warps=4)
    return out


# (BM, BN, BK, warps, stages) per kernel, tried on a shape's first eager call; the first is the default
# (the last three of each: less shared memory a program, so that two or three programs share an SM and one's first
# loads overlap another's stream; thirty-second session)
_CONFIGS = {
    "gate_up": ((16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 256, 8, 3), (32, 64, 128, 4, 3),
                (16, 128, 128, 8, 3), (16, 32, 256, 4, 3), (16, 64, 128, 4, 3), (16, 64, 64, 4, 4),
                (16, 64, 64, 4, 6)),
    "down": ((16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (32, 64, 128, 4, 3),
             (16, 128, 64, 4, 4), (16, 32, 128, 4, 4), (16, 64, 128, 4, 2), (16, 128, 128, 4, 2),
             (16, 64, 64, 4, 4)),
}
TUNED: dict = {}                 # (kernel, shape key) -> (config, {config: ms}) (benchmarks print them)


def _tuned(key, device, launch, out, kind: str):
    """The fastest configuration of `kind` for this shape (ops/tuning.py); 1e-2 relative tells a broken build
    from bf16 rounding."""
    cfgs = _CONFIGS[kind]
    return tuned_config(TUNED, key, cfgs, device, launch, out, cfgs[0], 1e-2)


def _desc(w2d: torch.Tensor, bn: int, bk: int):
    """A tensor descriptor of the 2-D weight view, read in [bn, bk] tiles (past its edges: zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w2d, [bn, bk])


def _bucket(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


class _Launch:
    """The two expert kernels' launches over one layer's weights and one batch of sorted rows (`experts_few_rows`;
    benchmarks/moe_bench.py times each kernel and configuration by them): up(cfg) writes hbuf [n*k, I] (silu(g) * u,
    sorted rows), down(cfg) writes ys [n*k, H] (each row times its routing weight, at its (token, choice) place)."""

    def __init__(self, x, weights, experts, gate_up, down, order, offs, desc: bool | None = None):
        n, k = experts.shape
        e, i2, hd = gate_up.shape
        i = i2 // 2
        if down.shape != (e, hd, i) or x.shape[-1] != hd:
            raise ValueError(f"expert shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                             f"down {tuple(down.shape)}")
        self.x = x.contiguous()
        self.w_up, self.w_down = gate_up.contiguous(), down.contiguous()
        self.order = order.contiguous()
        self.offs = offs.to(torch.int32).contiguous()
        self.wts = weights.reshape(-1).contiguous()
        self.hbuf = x.new_empty((n * k, i))
        self.ys = x.new_empty((n * k, hd))
        self.prec = "ieee" if x.dtype == torch.float32 else None       # fp32 operands (CPU interpreter tests): exact
        self.desc = (TMA_WEIGHTS if desc is None else desc) and descriptors_fit(gate_up, down)
        self.n, self.k, self.e, self.i, self.hd = n, k, e, i, hd
        self.key = (e, hd, i, k, _bucket(max(1, n * k // max(e, 1))), x.dtype, self.desc)

    def up(self, cfg):
        """The gate / up kernel, a program per tile: cfg (BM, BN, BK, warps, stages)."""
        bm, bn, bk, w, st = cfg
        gu, e, i, hd = self.w_up, self.e, self.i, self.hd
        wt = _desc(gu.view(e * 2 * i, hd), bn, bk) if self.desc else gu
        args = (self.x, self.order, self.offs, wt, self.hbuf, self.x.stride(0), gu.stride(0), gu.stride(1),
                self.hbuf.stride(0))
        kw = dict(H=hd, I=i, TOPK=self.k, BM=bm, BN=bn, BK=bk, STAGES=st, PREC=self.prec, DESC=self.desc, num_warps=w)
        _gate_up_kernel[(e, triton.cdiv(i, bn))](*args, **kw)

    def down(self, cfg):
        """The down kernel (configurations as `up`'s)."""
        bm, bn, bk, w, st = cfg
        dn, e, i, hd = self.w_down, self.e, self.i, self.hd
        wt = _desc(dn.view(e * hd, i), bn, bk) if self.desc else dn
        args = (self.hbuf, self.order, self.offs, self.wts, wt, self.ys, self.hbuf.stride(0), dn.stride(0),
                dn.stride(1), self.ys.stride(0))
        kw = dict(H=hd, I=i, TOPK=self.k, BM=bm, BN=bn, BK=bk, STAGES=st, PREC=self.prec, DESC=self.desc, num_warps=w)
        _down_kernel[(e, triton.cdiv(hd, bn))](*args, **kw)


def experts_few_rows(x, weights, experts, gate_up, down, order, offs, *, tune: bool = True, configs=None,
                     shared=None, desc: bool | None = None, rows=None):
    """The routed experts' sum for token rows already sorted by expert (fast.experts_forward's layout).

    x [n, H]; weights [n, k] (routing weights); experts [n, k]; gate_up [E, 2I, H] (gate rows first);
    down [E, H, I]; order [n*k]: row r of the sorted layout is choice order[r] (= t * k + j); offs [E]
    int32: expert e's rows end at offs[e] (inclusive cumulative counts). -> y [n, H] in x's dtype,
    y_t = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = experts[t, j].
    configs: (gate_up config, down config) to use instead of the tuned ones (tests, benchmarks).
    shared: (gate [n, 1], out [n, H]) of a shared expert, added as sigmoid(gate) * out (`combine`).
    desc: the weights read by tensor descriptors (None: the module's TMA_WEIGHTS, where
    `tuning.descriptors_fit`).
    rows ([1] int tensor or None): the tokens from rows[0] on are padding, their choices in no expert's rows (order and
    offs made so: triton_route.sort_by_expert's `real`); their routed sum is zero (`combine`)."""
    run = _Launch(x, weights, experts, gate_up, down, order, offs, desc)
    if configs is not None:
        cu, cd = configs
    elif tune:
        cu = _tuned(("gate_up",) + run.key, x.device, run.up, run.hbuf, "gate_up")
    else:
        cu = _CONFIGS["gate_up"][0]
    run.up(cu)
    if configs is None:
        cd = _tuned(("down",) + run.key, x.device, run.down, run.ys, "down") if tune else _CONFIGS["down"][0]
    run.down(cd)
    # each token's k rows summed in fp32 (and the shared expert's output added), rounded once
    n, k, hd = run.n, run.k, run.hd
    if COMBINE_KERNEL:
        return combine(run.ys, k, shared, rows)
    ys = run.ys.view(n, k, hd)
    if rows is not None:                          # (padding's rows unwritten: any bits, so replaced, not scaled)
        ys = torch.where((torch.arange(n, device=ys.device) < rows)[:, None, None], ys, 0.0)
    return with_shared(ys.sum(1, dtype=torch.float32).to(x.dtype), shared)
