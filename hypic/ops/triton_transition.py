"""Triton kernel: the transitions T of whole runs of the gated delta rule from their chunks' WY factors (CUDA; tests
run it in Triton's interpreter).

An isolated prefill caches each segment's rest (the tokens after its seam window) with its transition T, the state
map of its tokens: S_out = T S_in + S. fla's chunked forward already made, per chunk of 64 tokens, the WY factor w
(the chunk's "keys to subtract", w = (I + A)^-1 diag(beta e^G) K) and the chunk-local cumulative log2 decays G. With
zero values, the chunk-state recursion from the identity gives T:

    X <- I (the columns of this program's block); per chunk c of the run:
        V_c = -(W_c X) * 2^(G_last - G_t)    (rows past the run's end masked to zero)
        X   = 2^(G_last) X + K_c^T V_c
    T = X at the run's end.

That is what fla's chunk-state kernel computes when called with zero values and the identity as the initial state
(`fast._fla_transitions`, the default: see fast.TRANSITION_KERNEL for what H200 run 43 measured). That kernel also
stores every chunk's state (for its outputs stage; here nothing reads them: at 8k tokens 134 MB per layer). Here
nothing but T is written, the programs walk only the runs asked for (an isolated prefill's rests, not its seam
pieces), and the block of state columns per program is tuned (smaller blocks: more programs for one document's few
heads). The products take bf16 copies of the state as fla's do ("bf16", the default), or tf32 roundings of it (8x
finer; run 43 timed that form, slower than fla's at 8k).

Imported lazily (ops/fast.py): importing it needs triton, which CPU machines may lack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import tuned_config


@triton.jit
def _chunk(X, t0, eos, k, w, g, hv, hk, rk, mk, rt, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
           BT: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr):
    tt = t0 + rt
    mt = tt < eos
    m2 = mt[:, None] & mk[None, :]
    bw = tl.load(w + (tt[:, None] * HV + hv) * K + rk[None, :], mask=m2, other=0.0)                    # [BT, BK]
    kt = tl.load(k + (tt[None, :] * H + hk) * K + rk[:, None], mask=mk[:, None] & mt[None, :], other=0.0)  # [BK, BT]
    last = tl.minimum(t0 + BT, eos) - 1
    gl = tl.load(g + last * HV + hv).to(tl.float32)
    gt = tl.load(g + tt * HV + hv, mask=mt, other=0.0).to(tl.float32)
    scale = tl.where(mt, tl.exp2(gl - gt), 0.0)[:, None]
    if BF16:                        # fla's arithmetic: bf16 copies of the state and of the new values, fp32 sums
        vn = -tl.dot(bw.to(tl.bfloat16), X.to(tl.bfloat16)) * scale                                      # [BT, BV]
        return tl.dot(kt.to(tl.bfloat16), vn.to(tl.bfloat16), X * tl.exp2(gl))
    vn = -tl.dot(bw.to(tl.float32), X, input_precision=PREC) * scale
    return tl.dot(kt.to(tl.float32), vn, X * tl.exp2(gl), input_precision=PREC)


@triton.jit
def _transition_kernel(k, w, g, bounds, out, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr,
                       STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0)
    hv = tl.program_id(1)
    cb = tl.program_id(2)
    hk = hv // (HV // H)
    bos = tl.load(bounds + 2 * r).to(tl.int64)
    eos = tl.load(bounds + 2 * r + 1).to(tl.int64)
    rk = tl.arange(0, BK)
    cols = cb * BV + tl.arange(0, BV)
    mk = rk < K
    rt = tl.arange(0, BT)
    X = tl.where(rk[:, None] == cols[None, :], 1.0, 0.0)                      # [BK, BV]: the identity's columns
    if not INTERPRETED:
        for t0 in tl.range(bos, eos, BT, num_stages=STAGES):
            X = _chunk(X, t0, eos, k, w, g, hv, hk, rk, mk, rt, H, HV, K, BT, PREC, BF16)
    else:
        # Triton's interpreter cannot range over loaded bounds. Compiled for the GPU, this while loop is wrong in
        # the bf16 form (H200 run 45: T 1.5% off fla's at the test's shapes, an illegal address at the 35B ones)
        t0 = bos
        while t0 < eos:
            X = _chunk(X, t0, eos, k, w, g, hv, hk, rk, mk, rt, H, HV, K, BT, PREC, BF16)
            t0 += BT
    dst = out + ((r * HV + hv) * K + rk[:, None]).to(tl.int64) * K + cols[None, :]
    tl.store(dst, X, mask=mk[:, None] & (cols < K)[None, :])


# (column block, warps, pipeline stages) tried on a shape's first call; the first is the default. No unpipelined
# configuration: in H200 runs 45-46 every (32, 4, 1) build faulted (an illegal address) or was wrong in the bf16 form,
# both as a while loop and (apparently) as tl.range(num_stages=1); each of these five matched fla's pass bit for bit.
_CONFIGS = ((32, 4, 2), (16, 4, 2), (64, 4, 2), (16, 2, 2), (32, 8, 2))
TUNED: dict = {}


def transitions(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, bounds: torch.Tensor, *, chunk: int = 64,
                config: tuple | None = None, precision: str = "bf16") -> torch.Tensor:
    """k [1, N, H, K] (the l2-normalised keys fla's stages took), w [1, N, HV, K] (fla's WY factors), g [1, N, HV]
    (fla's chunk-local cumulative decays, log2), bounds [R, 2] int32 (device): run r is tokens bounds[r, 0] ..
    bounds[r, 1] - 1, whose chunks of `chunk` tokens start at its first token (as fla's varlen layout chunks
    every sequence) -> T [R, HV, K, K] fp32. config: (column block, warps, stages), else the tuned one.
    precision: "bf16" (fla's chunk-state arithmetic: the products take bf16 copies of the state and of the new
    values), or "tf32" / "tf32x3" / "ieee" for the products of fp32 copies (H200 run 43 timed "tf32": 2.6 us per
    chunk at 8k tokens against <= 1.65 for fla's bf16 kernel)."""
    if precision not in ("bf16", "tf32", "tf32x3", "ieee"):
        raise ValueError(f"unknown precision {precision!r}")
    _, n, h, dk = k.shape
    hv = w.shape[2]
    if w.shape != (1, n, hv, dk) or g.shape != (1, n, hv) or hv % h:
        raise ValueError(f"shapes do not fit: k {tuple(k.shape)}, w {tuple(w.shape)}, g {tuple(g.shape)}")
    k, w, g = k.contiguous(), w.contiguous(), g.contiguous()
    r = bounds.shape[0]
    out = torch.empty((r, hv, dk, dk), dtype=torch.float32, device=k.device)
    if r == 0:
        return out
    bk = max(16, triton.next_power_of_2(dk))

    def launch(cfg):
        bv, warps, stages = cfg
        _transition_kernel[(r, hv, triton.cdiv(dk, bv))](k, w, g, bounds, out, H=h, HV=hv, K=dk, BK=bk, BV=bv, BT=chunk,
                                                          PREC="tf32" if precision == "bf16" else precision,
                                                          BF16=precision == "bf16", STAGES=stages,
                                                          INTERPRETED=not k.is_cuda, num_warps=warps)

    if config is None:
        # tuned per (runs, heads, K, power-of-two bucket of the tokens per run): a short run's timing is the host's
        # launch time (H200 run 43 tuned at 504 tokens and kept an unpipelined configuration for 8k)
        per_run = max(1, n // r)
        config = tuned_config(TUNED, (min(r, 8), h, hv, dk, per_run.bit_length(), precision), _CONFIGS, k.device,
                              launch, out, _CONFIGS[0], 1e-5)
    launch(config)
    return out
