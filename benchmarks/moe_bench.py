"""The routed experts' two kernels alone at Qwen3.5-35B-A3B's shape, each form and configuration (CUDA; issue 3).

A warm `pic` request spends about half its GPU time in the routed experts (H200 run 107: 16.6 of 35.2 ms, the
weights read at ~3.9 TB/s against a copy rate of 4.2). This times ops/triton_moe.py's gate_up and down kernels one
by one, for every configuration of its tuner lists (a program per tile; a persistent form was removed after gpu_bench's H100
run 109 measured it +1.60 ms on the warm request),
with the weights read by pointers and by tensor descriptors (`TMA_WEIGHTS`), over several layers' weights in turn (as the model reads them), and beside them the rates at which
the GPU reads and copies plain memory:

    python benchmarks/moe_bench.py [--tokens 224,8,1] [--layers 4] [--reps 20] [--out DIR]

Each row: a kernel, a form, a configuration (BM, BN, BK, warps, stages), microseconds per launch (median of
rounds), and the rate at which it reads the weights of the experts in use. Every configuration's output is
compared with the pointer form's first configuration (1e-2 relative: bf16 rows; a broken build is far off).
Writes moe_bench.json."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic.ops import fast  # noqa: E402
from hypic.ops import triton_moe  # noqa: E402

E, HD, INTER, TOPK = 256, 2048, 512, 8          # (--tiny: a CPU dry run's shape under TRITON_INTERPRET=1)


def _events_ms(fn, reps: int) -> float:
    if not torch.cuda.is_available():        # (a dry run on the CPU under Triton's interpreter: wall time)
        t = time.perf_counter()
        for r in range(reps):
            fn(r)
        return (time.perf_counter() - t) * 1e3 / reps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for r in range(reps):
        fn(r)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="224,8,1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tiny", action="store_true", help="a dry run on the CPU (TRITON_INTERPRET=1), tiny shapes")
    ap.add_argument("--pads", type=int, default=0, help="also each token count with this many more rows, all one "
                    "row's copies (as the compose pass's pad tokens, which route alike: they pile onto one top-k set)")
    args = ap.parse_args()
    global E, HD, INTER
    if args.tiny:
        E, HD, INTER = 16, 64, 32
    dev = torch.device("cpu" if args.tiny else "cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    layers = [((torch.randn(E, 2 * INTER, HD, device=dev, generator=g) * 0.02).bfloat16(),
               (torch.randn(E, HD, INTER, device=dev, generator=g) * 0.02).bfloat16()) for _ in range(args.layers)]
    router = (torch.randn(E, HD, device=dev, generator=g) * 0.02).bfloat16()
    out = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               torch=torch.__version__,
               shape=dict(experts=E, hidden=HD, inter=INTER, top_k=TOPK, layers=args.layers), rows=[])

    # plain memory: a copy (read + write counted) and a read (a bf16 sum in fp32) of one layer's gate_up weights
    src = layers[0][0]
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    for _ in range(3):
        dst.copy_(src)
        src.sum(dtype=torch.float32)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    copy_ms = _events_ms(lambda r: dst.copy_(layers[r % args.layers][0]), args.reps)
    read_ms = _events_ms(lambda r: layers[r % args.layers][0].sum(dtype=torch.float32), args.reps)
    out["copy_TBps"] = 2 * nbytes / copy_ms / 1e9
    out["read_by_sum_TBps"] = nbytes / read_ms / 1e9
    print(f"plain memory, {nbytes / 1e9:.2f} GB: copy {out['copy_TBps']:.2f} TB/s (read + write), read (a sum) "
          f"{out['read_by_sum_TBps']:.2f} TB/s", flush=True)

    print(f"{'tokens':>6} {'kernel':>7} {'form':>7} {'config':>22} {'us':>8} {'TB/s':>6} {'rel':>8}", flush=True)
    counts = [(int(t), 0) for t in args.tokens.split(",")]
    if args.pads:
        counts += [(n, args.pads) for n, _ in counts]
    for n, pads in counts:
        x = (torch.randn(n, HD, device=dev, generator=g)).bfloat16()
        if pads:
            x = torch.cat([x, x[:1].expand(pads, HD)])
            n += pads
        w, ex = fast.route(x, router, TOPK, True)
        flat = ex.reshape(-1)
        order, offs = fast._sort_by_expert(flat, E, True)
        used = int(flat.unique().numel())
        most = int(torch.bincount(flat, minlength=E).max())
        print(f"{n:>6} tokens ({pads} of them one row's copies): {used} experts in use, at most {most} rows an expert",
              flush=True)
        runs = {desc: [triton_moe._Launch(x, w, ex, gu, dn, order, offs, desc=desc) for gu, dn in layers]
                for desc in (False, True)}
        wbytes = {"gate_up": used * 2 * INTER * HD * 2, "down": used * HD * INTER * 2}
        ref = {}
        for kind in ("gate_up", "down"):
            cfgs = triton_moe._CONFIGS[kind]
            for desc in (False, True):
                rl = runs[desc]
                if desc and not rl[0].desc:
                    print(f"{n:>6} {kind:>7} {'tma':>7}: tensor descriptors do not apply here", flush=True)
                    continue
                if kind == "down":
                    for r_ in rl:                        # the down kernel reads hbuf: each layer's, made once
                        r_.up(triton_moe._CONFIGS["gate_up"][0])
                for cfg in cfgs:
                    form = "tma" if desc else "ptr"
                    launch = (lambda r, c=cfg: rl[r % len(rl)].up(c)) if kind == "gate_up" else \
                        (lambda r, c=cfg: rl[r % len(rl)].down(c))
                    try:
                        launch(0)
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                    except Exception as e:           # a configuration this GPU / Triton cannot build
                        print(f"{n:>6} {kind:>7} {form:>7} {str(cfg):>22} failed: "
                              f"{type(e).__name__}: {str(e)[:120]}", flush=True)
                        out["rows"].append(dict(tokens=n, kernel=kind, form=form, config=cfg, error=str(e)[:300]))
                        continue
                    got = (rl[0].hbuf if kind == "gate_up" else rl[0].ys).clone()
                    base = ref.setdefault(kind, got)
                    err = rel(got, base)
                    ms = statistics.median(_events_ms(launch, args.reps) for _ in range(args.rounds))
                    tbps = wbytes[kind] / ms / 1e9
                    print(f"{n:>6} {kind:>7} {form:>7} {str(cfg):>22} {ms * 1e3:8.1f} {tbps:6.2f} {err:8.1e}",
                          flush=True)
                    out["rows"].append(dict(tokens=n, pads=pads, most_rows=most, kernel=kind, form=form, config=cfg,
                                            us=ms * 1e3, TBps=tbps, rel_vs_first=err, experts_used=used,
                                            weight_bytes=wbytes[kind]))
        best = {}
        for kind in ("gate_up", "down"):
            for form in ("ptr", "tma"):
                rows = [r for r in out["rows"] if r["tokens"] == n and r["kernel"] == kind and r["form"] == form
                        and "us" in r and r["rel_vs_first"] < 1e-2]
                if rows:
                    b = min(rows, key=lambda r: r["us"])
                    best[f"{kind} {form}"] = (b["config"], round(b["us"], 1), round(b["TBps"], 2))
        print(f"{n:>6} best: {best}", flush=True)
        out[f"best_{n}"] = {k: list(v) for k, v in best.items()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_bench.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
