"""Targets for Nsight Compute (one device call): the warm pic request's chain scan on its real shape (20
cached maps, 20 seams of 8 tokens, the query's 4 pieces of 16 and 2 pad runs, 32 heads of 128 x 128; runs'
transitions dense, outputs corrected in place) and the few-rows MoE kernels at 256 tokens on Qwen3.5-35B-A3B's
experts. Each is launched a few times after a warm-up, so ncu can skip the compiles and tuning:

    ncu --clock-control none -k regex:_scan_steps_kernel -s 26 -c 1 --section WarpStateStats ... \\
        python3 benchmarks/ncu_kernels.py scan
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic.ops import fast  # noqa: E402


def scan():
    from hypic.ops import triton_scan, triton_summary

    g = torch.Generator(device="cuda").manual_seed(3)
    h, k, v = 32, 128, 128
    T = torch.randn(20, h, k, k, device="cuda", generator=g) / k ** 0.5 * 0.9
    S = torch.randn(20, h, k, v, device="cuda", generator=g)
    lens = [8] * 20 + [16] * 6
    n = sum(lens)
    q = torch.randn(1, n, 16, k, device="cuda", generator=g).bfloat16()
    kk = torch.randn(1, n, 16, k, device="cuda", generator=g).bfloat16()
    vv = torch.randn(1, n, h, v, device="cuda", generator=g).bfloat16()
    gate = torch.empty(1, n, h, device="cuda").uniform_(0.9, 0.999, generator=g).log()
    beta = torch.rand(1, n, h, device="cuda", generator=g).bfloat16()
    cu_r = torch.tensor([0] + lens, device="cuda").cumsum(0)
    o, u, aug = triton_summary.chunk_summary(q, kk, vv, gate, beta, cu_r, 16, use_qk_l2norm_in_kernel=True)
    order = [20 + i // 2 if i % 2 == 0 else i // 2 for i in range(40)] + [40, 41, 42, 43, 44, 45]
    tok0 = cu_r[:-1].tolist()
    rows = []
    for m in order:
        if m < 20:
            rows.append([T[m].data_ptr(), S[m].data_ptr(), 0, m, 0, 0])
        else:
            i = m - 20
            rows.append([i * h * k * (v + k) * 4] * 2 + [1, m, tok0[i], lens[i]])
    steps = torch.tensor(rows, dtype=torch.long, device="cuda")
    cu2 = torch.tensor([0, 44, 46], dtype=torch.int32, device="cuda")
    init = torch.randn(2, h, k, v, device="cuda", generator=g)
    outs = torch.cat([o, u], -1)
    for _ in range(10):
        triton_scan.scan_steps(init, steps, cu2, aug, 46, outputs=outs, max_run=16)
    torch.cuda.synchronize()
    ck = triton_scan.COMPILED.get("steps")
    print("scan kernel registers / spills:", getattr(ck, "n_regs", None), getattr(ck, "n_spills", None),
          "tuned:", {kk_: v_[0] for kk_, v_ in triton_scan.TUNED.items()})


def moe():
    g = torch.Generator(device="cuda").manual_seed(5)
    e, hd, i, k, n = 256, 2048, 512, 8, 256
    gu = (torch.randn(e, 2 * i, hd, device="cuda", generator=g) * 0.02).bfloat16()
    dn = (torch.randn(e, hd, i, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(n, hd, device="cuda", generator=g).bfloat16()
    w, ex = fast.route(x, (torch.randn(e, hd, device="cuda", generator=g) * 0.02).bfloat16(), k, True)
    for _ in range(10):
        fast.experts_forward(x, w, ex, gu, dn)
    torch.cuda.synchronize()
    from hypic.ops import triton_moe

    print("moe tuned:", {kk_: v_[0] for kk_, v_ in triton_moe.TUNED.items()})


if __name__ == "__main__":
    {"scan": scan, "moe": moe}[sys.argv[1]]()
