"""The compose pass's chain scan alone, at the 35B benchmark's shape, in each form and launch configuration (CUDA).

The warm `pic` request's chain per linear layer: 20 seam runs of 8 tokens, each followed by its cached segment, then
4 query runs of 16 tokens; 32 value heads, K = V = 128; the runs' outputs corrected in place (FUSE_CORRECTION). Forms:

    dense        the default: runs' [S | T] dense (`scan_steps`)
    factored     runs' transitions as T = g I - Kd^T W (RUN_FACTORS)
    split        factored runs, and each cached T given pre-split (its tf32 part and the rest, `scan_steps(split=)`):
                 three tf32 products straight from shared memory, no split in the step (ptxas offline: 148 bytes of
                 spills at one stage against 224 for dense; two stages need 334 KB of shared memory: not built)

    prepaired    each seam run and the cached segment after it composed into one map before the scan,
                 [T_e S_r + S_e | T_e T_r] (`pair_maps`: one batched fp32 product per layer, timed apart), so the
                 chain is 24 steps of the dense default's run step (44 -> 24) with the kernel unchanged; the row's
                 time is the scan alone, `pair_us` the product (the fourteenth session's `pairs` composed them inside
                 the step instead and lost to its register pressure)

    lowrank      the prepaired chain with the pairs made from the runs' low-rank factors
                 (T_r = g I - Kd^T W, S_r = Kd^T U: `ops/triton_scan.pair_lowrank`, [S_e + P U | g T_e - P W] with P = T_e Kd^T; twenty-ninth session),
                 each block-rows / warps configuration timed apart and checked against the dense pairs in fp64
    position     the lowrank chain taken by position in the pairs' buffer (STEP_BY_POSITION, `_by_position`: two maps
                 in flight in shared memory, three tf32 products of M as loaded; thirty-sixth session), its corrected
                 outputs in bf16 as the compose pass's (checked within their rounding, 4e-3)
    pairs        the position chain with each pair made inside the scan (`ops/triton_scan.scan_pairs`: the run from x
                 by its factors and values, then the cached map read in place; fortieth session): no pair kernel, no
                 pairs' buffer written and read back; bf16 outputs as `position`

(Runs 54-55 also timed, at git 4a0a8c6, a seam run and the segment after it as one step and the state held
transposed: both slower, removed; their rows are in benchmarks/results/gpu/scan_bench_run5{4,5}.json.)
--wide: the 16-warp configurations. Each form is checked against the fp64 chain (1e-5 relative, as tests/test_gpu.py) and timed by CUDA events over
--reps launches after a warm-up (median per launch). Prints a table and writes JSON.

    python benchmarks/scan_bench.py [--reps 50] [--out benchmarks/results]      # on the device
    TRITON_INTERPRET=1 python benchmarks/scan_bench.py --device cpu --heads 1 --reps 1 --out /tmp/sb   # a dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, K, V, E, L, W = 32, 128, 128, 20, 8, 16          # heads, key / value dims, segments, seam, factor width
QRUNS, QLEN = 4, 16


def chain(dev):
    """The maps, tables and run outputs of one request's chain at the 35B shape (random maps of norm ~0.9)."""
    g = torch.Generator(device=dev).manual_seed(5)
    n = E + QRUNS
    init = torch.randn(1, H, K, V, device=dev, generator=g)
    T = torch.randn(E, H, K, K, device=dev, generator=g) / K ** .5 * .9
    S = torch.randn(E, H, K, V, device=dev, generator=g)
    F = torch.zeros(n, H, 2 * W + 1, K, device=dev)
    lens = [L] * E + [QLEN] * QRUNS
    for i, ln in enumerate(lens):
        F[i, :, :ln] = torch.randn(H, ln, K, device=dev, generator=g) / K ** .5 * .4
        F[i, :, W:W + ln] = torch.randn(H, ln, K, device=dev, generator=g) / K ** .5 * .4
    F[:, :, 2 * W, 0] = 0.9 + 0.1 * torch.rand(n, H, device=dev, generator=g)
    U = torch.zeros(n, H, W, V, device=dev)             # a run's S = Kd^T U (its WY-solved values; `lowrank`)
    for i, ln in enumerate(lens):
        U[i, :, :ln] = torch.randn(H, ln, V, device=dev, generator=g)
    S_r = F[:, :, :W].transpose(-1, -2) @ U
    from hypic.ops.reference.gated_delta import factors_to_dense

    dense = factors_to_dense(S_r, F).contiguous()
    from hypic.ops.triton_scan import split_tf32

    T_hi, T_lo = split_tf32(T)                          # each cached T as the `split` form reads it
    order = [m for i in range(E) for m in (E + i, i)] + list(range(2 * E, E + n))
    t0s, acc = {}, 0
    for m in order:
        if m >= E:
            t0s[m] = acc
            acc += lens[m - E]
    outs = torch.randn(acc, H, V + K, device=dev, generator=g)
    return dict(init=init, T=T, S=S, S_r=S_r, F=F, dense=dense, order=order, t0s=t0s, lens=lens, outs=outs, n=n,
                T_hi=T_hi, T_lo=T_lo, U=U)


def pair_maps(c, out=None):
    """[T_e S_r + S_e | T_e T_r] for each seam run and the cached segment after it, the query runs' [S | T] as they
    are: the maps of the 24-step chain. fp32 products at full precision (no tf32): the maps stay fp32-exact.
    With `out` (made by an earlier call) only the pairs are rewritten, as a per-layer buffer would be: what is timed."""
    if out is None:
        out = c["dense"].clone()
    torch.matmul(c["T"], c["dense"][:E], out=out[:E])  # [E, H, K, V + K]
    out[:E, ..., :V] += c["S"]
    return out


def tables(c, form, dev):
    """The chain's step table for a form (its columns as `scan_steps` documents them) and cu."""
    t0s, lens = c["t0s"], c["lens"]
    if form in ("dense", "prepaired", "lowrank", "position", "pairs"):   # a run's (or a pair's) [S | T] at its offset
        run_row = lambda m: [(m - E) * H * K * (V + K) * 4] * 2  # noqa: E731
    else:                                                # a run's factors, then its S
        run_row = lambda m: [(m - E) * H * (2 * W + 1) * K * 4, (m - E) * H * K * V * 4]  # noqa: E731
    rows = []
    for m in c["order"]:
        if m < E and form in ("prepaired", "lowrank", "position", "pairs"):   # composed into the run before it
            continue
        if m < E and form == "split":                    # T's tf32 part at column 0, the rest at column 6
            rows.append([c["T_hi"][m].data_ptr(), c["S"][m].data_ptr(), 0, m, 0, 0, c["T_lo"][m].data_ptr()])
        elif m < E:
            rows.append([c["T"][m].data_ptr(), c["S"][m].data_ptr(), 0, m, 0, 0])
        else:
            rows.append(run_row(m) + [1, m, t0s[m], lens[m - E]] + ([0] if form == "split" else []))
    if form in ("position", "pairs"):                    # every step a pair's map at the next slot: by position
        from hypic.compose.scan import STEP_BY_POSITION

        rows[0][2] |= STEP_BY_POSITION
    steps = torch.tensor(rows, dtype=torch.int64, device=dev)
    cu = torch.tensor([0, len(rows)], dtype=torch.int32, device=dev)
    return steps, cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--heads", type=int, default=H, help="fewer for a dry run in Triton's interpreter on the CPU")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--wide", action="store_true", help="the 16-warp configurations instead")
    ap.add_argument("--forms", default="", help="only these forms (comma-separated), e.g. lowrank,position")
    args = ap.parse_args()
    globals()["H"] = args.heads
    from launches import first_launch, launch_times

    from hypic.compose import scan as sc
    from hypic.ops import triton_scan as ts

    dev = torch.device(args.device)
    c = chain(dev)
    b0, f0 = sc.scan_dense_reference(c["init"].double(), c["T"].double(), c["S"].double(), [0, len(c["order"])],
                                     c["order"], c["dense"].double())
    runs_in_order = [m for m in c["order"] if m >= E]
    reps_l = [c["lens"][m - E] for m in runs_in_order]
    starts = b0[runs_in_order].double().repeat_interleave(torch.tensor(reps_l, device=dev), 0)
    want = c["outs"][..., :V].double() + torch.einsum("nhk,nhkv->nhv", c["outs"][..., V:].double(), starts)
    outs16 = c["outs"].bfloat16()          # `position` corrects bf16 outputs (the compose pass's summaries write bf16)
    want16 = outs16[..., :V].double() + torch.einsum("nhk,nhkv->nhv", outs16[..., V:].double(), starts)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    forms = {"dense": [(32, 8, 2), (32, 8, 1), (64, 8, 2), (32, 4, 2)], "factored": [(32, 8, 2), (32, 8, 1)],
             "split": [(32, 8, 1), (16, 4, 1), (32, 4, 1), (16, 8, 1), (64, 8, 1)],
             "prepaired": [(32, 8, 2), (32, 8, 1)], "lowrank": [(32, 8, 2), (32, 8, 1)],
             "position": [(32, 8, 2), (32, 8, 1), (32, 4, 2)], "pairs": list(ts.PAIRS_SCAN_CONFIGS)}
    if args.forms:
        forms = {f: forms[f] for f in args.forms.split(",")}
    if args.wide:              # 16 warps: T [128 x 128] at 32 registers per thread instead of 64 (run 31 saw a fault
        forms = {"dense": [(32, 16, 2), (32, 16, 1), (64, 16, 1)]}       # in the factored form with 16 warps)
    torch.backends.cuda.matmul.allow_tf32 = False      # pair_maps at full fp32 precision
    paired = pair_maps(c)
    pair_t = launch_times(lambda: pair_maps(c, paired), args.reps, dev.type == "cuda")
    print(f"pair_maps: {pair_t['us']:.1f} us (min {pair_t['us_min']:.1f}) per layer", flush=True)
    # the pairs from the runs' low-rank factors (ops/triton_scan.pair_lowrank), each block-rows / warps tried
    pairs_t = torch.tensor([[c["T"][i].data_ptr(), c["S"][i].data_ptr(), i, 0] for i in range(E)]
                           + [[0, 0, i, 0] for i in range(E, c["n"])], dtype=torch.int64, device=dev)
    lowrank = torch.empty_like(c["dense"])
    lr_rows = []
    want_lr = torch.cat([c["T"].double() @ c["dense"][:E, ..., :V].double() + c["S"].double(),    # the pairs, fp64
                         c["T"].double() @ c["dense"][:E, ..., V:].double()], -1)
    lr_cfgs = [(br, w, hv, "tf32x3") for br, w, hv in ts.PAIR_CONFIGS] + [(32, 4, False, "ieee")] \
        if dev.type == "cuda" else [(16, 4, False, "ieee"), (16, 4, True, "ieee")]
    for br, w, hv, prec in lr_cfgs:
        def pl(br=br, w=w, hv=hv, prec=prec):
            return ts.pair_lowrank(pairs_t, c["F"], c["U"], lowrank, block_rows=br, warps=w, halves=hv,
                                   precision=prec)
        lowrank.fill_(float("nan"))                       # every row must be written by this configuration
        try:
            pl()
            t = launch_times(pl, args.reps, dev.type == "cuda")
        except Exception as e:                            # a build the device cannot run: its row says so
            lr_rows.append(dict(block_rows=br, warps=w, halves=hv, precision=prec,
                                error=f"{type(e).__name__}: {str(e)[:120]}"))
            print(lr_rows[-1], flush=True)
            continue
        lr_rel = rel(lowrank[:E], want_lr)
        lr_rows.append(dict(block_rows=br, warps=w, halves=hv, precision=prec, us=t["us"], us_min=t["us_min"],
                            rel=lr_rel, query_rel=rel(lowrank[E:], c["dense"][E:].double())))
        print(f"pair_lowrank (rows {br}, warps {w}, halves {hv}, {prec}): {t['us']:.1f} us (min {t['us_min']:.1f}) "
              f"per layer; rel {lr_rel:.1e}", flush=True)
    br, w, hv, prec = lr_cfgs[0]                          # the chain below reads the default configuration's pairs
    ts.pair_lowrank(pairs_t, c["F"], c["U"], lowrank, block_rows=br, warps=w, halves=hv, precision=prec)
    lr_best = min((r["us"] for r in lr_rows if "us" in r), default=None)
    rows, t_start = [], time.time()
    for form, cfgs in forms.items():
        if any(r.get("fault") for r in rows):          # the CUDA context is lost: nothing more can run
            break
        steps, cu = tables(c, form, dev)
        outs = outs16 if form in ("position", "pairs") else c["outs"]
        for cfg in cfgs:
            got = outs.clone()

            def launch(o=got, steps=steps, cu=cu, cfg=cfg, form=form):
                kw = dict(outputs=o, max_run=QLEN, bv=cfg[0], warps=cfg[1], stages=cfg[2])
                if form == "pairs":
                    return ts.scan_pairs(c["init"], steps, cu, pairs_t, c["F"], c["U"], **kw)
                if form in ("dense", "prepaired", "lowrank", "position"):
                    maps = {"prepaired": paired, "lowrank": lowrank, "position": lowrank}.get(form, c["dense"])
                    return ts.scan_steps(c["init"], steps, cu, maps, E + c["n"], position=form == "position", **kw)[1]
                return ts.scan_steps(c["init"], steps, cu, c["S_r"], E + c["n"], factors=c["F"], split=form == "split",
                                     **kw)[1]
            row = dict(form=form, config=list(cfg), steps=int(steps.shape[0]))
            if form == "prepaired":
                row["pair_us"] = pair_t["us"]
            if form in ("lowrank", "position"):
                row["pair_us"] = lr_best
            final = first_launch(launch, dev.type == "cuda", row, rows)
            if final is None:
                if row["fault"]:
                    break
                continue
            # (bf16 outputs: the corrected ones within their own rounding, 2^-9 relative)
            row["final_rel"] = rel(final, f0[0])
            bf16 = form in ("position", "pairs")
            row["corrected_rel"] = rel(got[..., :V], want16 if bf16 else want)
            ok = row["final_rel"] < 1e-5 and row["corrected_rel"] < (4e-3 if bf16 else 1e-5)
            scratch = outs.clone()
            row.update(launch_times(lambda: launch(scratch), args.reps, dev.type == "cuda"), ok=ok)
            comp = ts.COMPILED.get("pairs_scan" if form == "pairs" else "steps")
            if comp is not None:
                row.update(regs=getattr(comp, "n_regs", None), spills=getattr(comp, "n_spills", None))
            rows.append(row)
            print(f"{form:11s} {str(cfg):13s} {row['us']:8.1f} us/launch (min {row['us_min']:.1f}); steps "
                  f"{row['steps']}; rel {row['final_rel']:.1e} / {row['corrected_rel']:.1e}; regs {row.get('regs')} "
                  f"spills {row.get('spills')}{'' if ok else '  WRONG'}", flush=True)
    print("\n| form | config (bv, warps, stages) | steps | us per launch (median) | registers | spills | fp64 check |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "us" in r:
            print(f"| {r['form']} | {tuple(r['config'])} | {r['steps']} | {r['us']:.1f} | {r.get('regs')} | "
                  f"{r.get('spills')} | {'ok' if r['ok'] else 'WRONG'} |")
        else:
            print(f"| {r['form']} | {tuple(r['config'])} | {r['steps']} | not built: {r['error'][:60]} | | | |")
    best = {f: min((r["us"] for r in rows if r["form"] == f and r.get("ok")), default=None) for f in forms}
    print("best per form (us):", best, f"({time.time() - t_start:.0f} s); prepaired + pair_maps:",
          None if best.get("prepaired") is None else round(best["prepaired"] + pair_t["us"], 1), "; lowrank + "
          "pair_lowrank:",
          None if best.get("lowrank") is None or lr_best is None else round(best["lowrank"] + lr_best, 1),
          "; position + pair_lowrank:",
          None if best.get("position") is None or lr_best is None else round(best["position"] + lr_best, 1),
          "; pairs (no pair kernel):", best.get("pairs"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)"
    (out / "scan_bench.json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=name,
                                                          torch=torch.__version__, rows=rows, best=best,
                                                          pair_maps_us=pair_t["us"], pair_lowrank=lr_rows), indent=1))


if __name__ == "__main__":
    main()
