"""The linear layer's share of building (T, S) in an isolated segment prefill, at the 35B model's head shapes
(16 key heads, 32 value heads, K = V = 128), without the model: one GDN layer's isolated prefill
(fast.chunk_gated_delta_isolated: seam window, one pass over the cut layout, the rest's transition) against the
plain chunked forward of the same tokens, with the transitions by ops/triton_transition.py and by fla's
chunk-state pass (the default), side by side; and the transition step alone. CUDA events, the
median of `--reps` timings of `--inner` calls each. Prints a table and writes JSON.

    python benchmarks/transition_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic.ops import fast  # noqa: E402


def timed(fn, reps: int, inner: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from hypic.ops import triton_transition      # needs triton (the GPU machine)

    dev = "cuda"
    h, hv, dk, dv, seam = 16, 32, 128, 128, 8
    g = torch.Generator(device=dev).manual_seed(0)
    rows = {}
    for n in (int(x) for x in args.sizes.split(",")):
        q = torch.randn(1, n, h, dk, device=dev, generator=g).bfloat16()
        k = torch.randn(1, n, h, dk, device=dev, generator=g).bfloat16()
        v = torch.randn(1, n, hv, dv, device=dev, generator=g).bfloat16()
        gate = torch.empty(1, n, hv, device=dev).uniform_(0.9, 0.999, generator=g).log()
        beta = torch.rand(1, n, hv, device=dev, generator=g).bfloat16()
        cu = torch.tensor([0, n])
        kw = dict(g=gate, beta=beta, use_qk_l2norm_in_kernel=True)

        def plain():
            fast.chunk_gated_delta_rule(q, k, v, cu_seqlens=cu, output_final_state=True, **kw)

        def isolated(kernel_t: bool):
            with mock.patch.object(fast, "TRANSITION_KERNEL", kernel_t):
                fast.chunk_gated_delta_isolated(q, k, v, cu_seqlens=cu, seams=[seam], **kw)

        e = {"plain_ms": timed(plain, args.reps, args.inner),
             "isolated_ms": timed(lambda: isolated(True), args.reps, args.inner),
             "isolated_fla_T_ms": timed(lambda: isolated(False), args.reps, args.inner)}
        # the transition step alone, on the forward's own WY factors (the cut layout: seam, rest)
        st = fast._fla_stages()
        qq, kk, vv, bb, sc = fast._stages_prepare(st, q, k, v, beta, None, True)
        split = torch.tensor([0, seam, n])
        init = torch.zeros(2, hv, dk, dv, device=dev)
        _, _, reuse = fast._stages_forward(st, qq, kk, vv, gate, bb, sc, split, init)
        w, gc, cu_d, chunks, _ = reuse
        bounds = torch.tensor([[seam, n]], dtype=torch.int32, device=dev)
        e["T_kernel_ms"] = timed(lambda: triton_transition.transitions(kk, w, gc, bounds), args.reps, args.inner)
        e["T_kernel_tf32_ms"] = timed(lambda: triton_transition.transitions(kk, w, gc, bounds, precision="tf32"),
                                      args.reps, args.inner)
        e["T_fla_ms"] = timed(lambda: fast._fla_transitions(st, kk, w, gc, cu_d, chunks, 2), args.reps, args.inner)
        t_new = triton_transition.transitions(kk, w, gc, bounds)
        t_old = fast._fla_transitions(st, kk, w, gc, cu_d, chunks, 2)[1::2]
        # (over thousands of tokens T decays towards zero: the relative difference is reported only where it is not)
        e["T_norm"] = float(t_old.norm())
        e["T_max_abs_diff"] = float((t_new - t_old).abs().max())
        e["T_rel_diff"] = float((t_new - t_old).norm() / t_old.norm()) if e["T_norm"] > 1e-20 else None
        e["overhead"] = e["isolated_ms"] / e["plain_ms"] - 1
        e["overhead_fla_T"] = e["isolated_fla_T_ms"] / e["plain_ms"] - 1
        rows[n] = e
    print("(times per call, CUDA events over back-to-back calls: where the host is slower than the GPU they are the "
          "host's)")
    print("| tokens | plain layer | isolated (T kernel) | isolated (fla T) | T kernel (bf16) | T kernel (tf32) | fla T pass "
          "| T rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for n, e in rows.items():
        print(f"| {n} | {e['plain_ms'] * 1e3:.0f} us | {e['isolated_ms'] * 1e3:.0f} us ({e['overhead'] * 100:+.0f}%) | "
              f"{e['isolated_fla_T_ms'] * 1e3:.0f} us ({e['overhead_fla_T'] * 100:+.0f}%) | {e['T_kernel_ms'] * 1e3:.0f} us | "
              f"{e['T_kernel_tf32_ms'] * 1e3:.0f} us | "
              f"{e['T_fla_ms'] * 1e3:.0f} us | {e['T_rel_diff'] if e['T_rel_diff'] is None else format(e['T_rel_diff'], '.1e')} |")
    print("tuned:", {str(k): v[0] for k, v in triton_transition.TUNED.items()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transition_bench.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(), "rows": rows,
         "tuned": {str(k): [list(v[0]), {str(c): t for c, t in v[1].items()}] for k, v in triton_transition.TUNED.items()}},
        indent=1))


if __name__ == "__main__":
    main()
