"""Each configuration of the transition kernel (ops/triton_transition.py) in a process of its own, so that one that
faults on the GPU (an illegal address poisons the process's CUDA context, so the tuner cannot skip it) is named
rather than taking the others down: for every precision and (column block, warps, stages), the kernel's T against
fla's chunk-state pass from the identity on the same WY factors, at the GPU test's shapes and at the 35B model's.
Prints a table and writes JSON.

    python benchmarks/transition_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"test": dict(lens=[70, 200, 1, 700], h=2, hv=4, dk=64), "35b-2k": dict(lens=[2040], h=16, hv=32, dk=128)}


def one(shape: str, precision: str, config: tuple) -> dict:
    """In this process: the kernel once under the given configuration, against fla's pass."""
    import torch

    from hypic.ops import fast, triton_transition

    s = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, hv, dk = sum(s["lens"]), s["h"], s["hv"], s["dk"]
    q = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, n, hv, dk, device="cuda", generator=g).bfloat16()
    gate = torch.empty(1, n, hv, device="cuda").uniform_(0.9, 0.999, generator=g).log()
    beta = torch.rand(1, n, hv, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0] + s["lens"]).cumsum(0)
    st = fast._fla_stages()
    qq, kk, vv, bb, sc = fast._stages_prepare(st, q, k, v, beta, None, True)
    _, _, reuse = fast._stages_forward(st, qq, kk, vv, gate, bb, sc, cu, None)
    w, gc, cud, chunks, _ = reuse
    bounds = torch.stack([cu[:-1], cu[1:]], 1).to(torch.int32).cuda()
    want = fast._fla_transitions(st, kk, w, gc, cud, chunks, len(s["lens"])).float()
    got = triton_transition.transitions(kk, w, gc, bounds, config=config, precision=precision)
    torch.cuda.synchronize()
    return {"finite": bool(torch.isfinite(got).all()), "rel_vs_fla": float((got - want).norm() / want.norm())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", nargs=3, metavar=("SHAPE", "PRECISION", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        shape, precision, cfg = args.one
        print("RESULT " + json.dumps(one(shape, precision, tuple(int(x) for x in cfg.split(",")))))
        return
    from hypic.ops.triton_transition import _CONFIGS

    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    rows = []
    print(f"{'shape':8} {'precision':9} {'config':12} {'outcome':10} rel vs fla")
    for shape in SHAPES:
        for precision in ("bf16", "tf32"):
            for cfg in _CONFIGS:
                p = subprocess.run([sys.executable, __file__, "--one", shape, precision, ",".join(map(str, cfg))],
                                   capture_output=True, text=True, env=env, timeout=300)
                res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                row = dict(shape=shape, precision=precision, config=list(cfg), rc=p.returncode)
                if res:
                    row.update(json.loads(res[0][7:]))
                    outcome = "ok" if row["finite"] else "nonfinite"
                else:
                    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
                    row["error"] = tail[-300:]
                    outcome = "fault" if "illegal" in p.stderr else "error"
                row["outcome"] = outcome
                rows.append(row)
                print(f"{shape:8} {precision:9} {str(cfg):12} {outcome:10} {row.get('rel_vs_fla', '')} "
                      f"{row.get('error', '')[:120]}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "transition_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
