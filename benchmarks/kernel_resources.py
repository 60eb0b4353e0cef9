"""Registers, spills and shared memory of the chain scan's builds for the H200 (sm_90a), on a machine without a GPU;
then those of the compose attention, its fold, the MoE combine, the low-rank pair kernel, the query tail's epilogue, the
routed experts' kernels (each configuration and form) and the chunked summary.

Triton compiles for a named target without a device, and the ptxas it ships reports each build's registers and
spills: the H200's own numbers for the same source and specialisation (H200 run 54 reported 255 registers and 58
spilled values for the default dense build, (32, 8, 2); this gives 255 registers and 224 bytes of spill stores, 56
values; for the factored build the device counted 82-122 spilled values, this 59-89: indicative, not exact). So a
change meant to relieve the scan's register pressure can be judged here before a device call. Shared memory above
the H200's 227 KB means the build cannot run there.

    python benchmarks/kernel_resources.py [--out benchmarks/results/kernel_resources.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.modules["fla"] = None

SMEM_LIMIT = 232448          # bytes per block on the H200 (Triton's OutOfResources limit there)


def scan_build(bv=32, warps=8, stages=2, factors=False, correct=True, split=False, position=None):
    """Compile `_scan_steps_kernel` at the 35B shape (32 heads, K = V = 128) for sm_90a; (registers, spill stores
    and loads in bytes, shared memory in bytes) from ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hypic.ops import triton_scan as ts

    names = ["init", "steps", "a_addr", "f_addr", "before", "final", "cu", "ou", "s_ot", "s_oh", "maps"]
    sig = dict(zip(names, ["*fp32", "*i64", "i64", "i64", "*fp32", "*fp32", "*i32", "*bf16", "i32", "i32", "*fp32"]))
    if position is None:            # as scan_steps compiles it: dense maps with the correction (ops/triton_scan.py)
        position = ts.BY_POSITION and not factors and correct and not split and ts.position_fits(128, bv)
    const = dict(H=32, K=128, V=128, BK=128, BV=bv, PREC="tf32x3", STAGES=stages, W=7 if split else 6,
                 CORRECT=correct, BT=16, FACTORS=factors, BF=16, EVEN=True, SPLIT=split, POSITION=position,
                 EMULATE=False)
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}     # as the device specialises them
    src = ASTSource(fn=ts._scan_steps_kernel, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    regs, stores, loads = _ptxas_counts(k)
    return dict(registers=regs, spill_store_bytes=stores, spill_load_bytes=loads, shared=k.metadata.shared)


def _ptxas_counts(k):
    """A compiled Triton kernel's (registers, spill stores, spill loads in bytes) from the ptxas Triton ships, -v
    for sm_90a (None where ptxas does not say)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    used = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    stores, loads = (int(spills.group(1)), int(spills.group(2))) if spills else (None, None)
    return int(used.group(1)) if used else None, stores, loads


def kernel_build(fn, sig: dict, const: dict, warps: int, stages: int = 1, divisible=()):
    """Compile any Triton kernel for sm_90a (pointer arguments: those typed "*..."); (registers, spill stores in
    bytes, shared memory in bytes) from ptxas -v. divisible: the integer arguments the launch specialises as multiples
    of 16 (Triton does so for any such value: a row stride of 2,048 elements is one; left out, the loads they address
    cannot be vectorised and the build differs from the device's: the MoE kernel then showed 2 KB of spills and no
    shared-memory pipeline)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    sig = dict(sig, **{k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in divisible}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    regs, stores, _ = _ptxas_counts(k)
    return regs, stores, k.metadata.shared


def other_builds():
    """The compose pass's other kernels (since the twenty-ninth session) at the 35B warm request's shapes:
    [(kernel, configuration, build)]."""
    from hypic.ops import triton_attention as ta, triton_moe as tm, triton_place as tp, triton_scan as ts
    from hypic.ops import triton_summary as tsum

    rows = []
    att = dict(q="*bf16", k="*bf16", v="*bf16", qpos="*i64", kpos="*i64", acc_out="*fp32", m_out="*fp32",
               l_out="*fp32", Nq="i32", Nk="i32", per_split="i32", blocks="i32", n_splits="i32", scale="fp32")
    for ff, bal, d, dv, bd in ((False, False, 256, 256, 256), (True, True, 256, 256, 256), (True, True, 24, 16, 32)):
        const = dict(H=16, HKV=2, REP=8, D=d, DV=dv, BD=bd, BDV=bd, BM=128, BN=64, SORTED=True, STAGES=2,
                     FULL_FAST=ff, BALANCE=bal, VSPLIT=1)
        rows.append(("attention", f"full_fast {ff}, balance {bal}, D {d} / Dv {dv}",
                     kernel_build(ta._partial_kernel, att, const, 8, 2)))
    # (the split count a constant since the 39th session, rounded up to ta.FOLD_BUCKET since the 41st: 2, 4 and 8
    # programs an SM; 0: the run-time loop, for more than ta.FOLD_UNROLL splits)
    for splits in (ta._fold_splits(9), ta._fold_splits(17), ta.FOLD_UNROLL, 0):
        rows.append(("attention fold", f"BR 16, BDV 128, {splits or 'a run-time count of'} splits", kernel_build(
            ta._fold_kernel, dict(acc="*fp32", m="*fp32", l="*fp32", out="*bf16", nrows="i32", n_splits="i32"),
            dict(H=16, HKV=2, REP=8, DV=256, BR=16, BDV=128, SPLITS=splits), 4)))
    rows.append(("moe combine", "top 8, shared", kernel_build(
        tm._combine_kernel, dict(ys="*bf16", sg="*bf16", so="*bf16", out="*bf16", s_so="i32", s_sg="i32"),
        dict(H=2048, TOPK=8, SHARED=True, BH=1024), 4)))
    for br, w, prec, hv in ((32, 4, "tf32x3", False), (32, 4, "ieee", False), (64, 8, "ieee", False),
                            (32, 4, "tf32x3", True), (64, 4, "tf32x3", True), (64, 8, "tf32x3", True),
                            (32, 4, "tf32x3", 32), (64, 4, "tf32x3", 32), (64, 8, "tf32x3", 64),
                            (128, 8, "tf32x3", 32), (32, 4, "tf32x3", "first"), (64, 8, "tf32x3", "first")):
        halves, bc, first = ts.pair_form(hv)
        form = ", halves" if halves else ", loads first" if first else f", chunks of {bc}" if bc else ""
        rows.append(("pair_lowrank", f"rows {br}, warps {w}, {prec}{form}", kernel_build(
            ts._pair_lowrank_kernel, dict(pairs="*i64", F="*fp32", U="*fp32", out="*fp32"),
            dict(H=32, K=128, V=128, WF=16, BR=br, PREC=prec, PW=6, HALVES=halves, BC=bc, FIRST=first,
                 ALIGNED=ts.PAIR_ALIGNED), w)))
    for br, w, form in ts.PAIR_CONFIGS:              # the persistent forms (37th session): a pipelined loop of items
        if ts.pair_stages(form):
            rows.append(("pair_lowrank", f"rows {br}, warps {w}, tf32x3, {form}", kernel_build(
                ts._pair_persistent_kernel, dict(pairs="*i64", F="*fp32", U="*fp32", out="*fp32", P="i32"),
                dict(H=32, K=128, V=128, WF=16, BR=br, PREC="tf32x3", PW=6, SKIP=False, ALIGNED=ts.PAIR_ALIGNED,
                     STAGES=ts.pair_stages(form)), w, stages=ts.pair_stages(form))))
    # the pairs made inside the chain scan (40th session): each tuner configuration
    sp = dict(init="*fp32", steps="*i64", pairs="*i64", F="*fp32", U="*fp32", final="*fp32", cu="*i32", ou="*bf16",
              s_ot="i32", s_oh="i32")
    for bv, w, st in ts.PAIRS_SCAN_CONFIGS:
        rows.append(("scan_pairs", f"value block {bv}, warps {w}, stages {st}", kernel_build(
            ts._scan_pairs_kernel, sp, dict(H=32, K=128, V=128, BV=bv, W=6, BT=16, WF=16, PW=6, PREC="tf32x3",
                                            STAGES=st, EMULATE=False), w, stages=st, divisible={"s_ot", "s_oh"})))
    tail = dict(o="*bf16", u="*bf16", s0="*fp32", U="*fp32", F="*fp32", cu="*i64", final="*fp32", N="i32",
                s_on="i32", s_oh="i32", s_un="i32", s_uh="i32")
    for bv, w in ((32, 4), (16, 4), (32, 8)):          # the query's tail (32nd session): 4 runs of 16, K = V = 128
        rows.append(("tail_epilogue", f"value block {bv}, warps {w}", kernel_build(
            ts._tail_kernel, tail, dict(HV=32, K=128, V=128, WF=16, BV=bv, BT=16, NT=4, PREC="tf32x3"), w,
            divisible={"s_on", "s_oh", "s_un", "s_uh"})))
    # the compose pass's key ordering (35B: 2 KV heads x 256, RoPE over 64 dims), packed and by address (32nd session)
    order = dict(keys="*bf16", values="*bf16", kperm="*i64", free="*bf16", cos="*bf16", sin="*bf16", ok="*bf16",
                 ov="*bf16", M="i32", lo="i32", n_free="i32", cs_stride="i32", etab="*i64", n_ent="i32")
    for ent in (False, True):
        rows.append(("order_keys", "entries by address" if ent else "packed", kernel_build(
            tp._order_kernel, order, dict(W=512, WV=512, D=256, R=64, HALF=32, BW=512, BWV=512, BR=8, PLACE=True,
                                          ENTRIES=ent, LOGE=5, EW=6, ALIGNED=ent), 8)))
    # the routed experts (32nd session): each kernel and configuration, its weights by pointers and by tensor
    # descriptors (TMA), at the 35B shape (H 2,048, I 512, top 8)
    moe = {"gate_up": (dict(x="*bf16", order="*i64", offs="*i32", w="*bf16", h="*bf16", s_x="i32", s_we="i32",
                            s_wn="i32", s_h="i32"), tm._gate_up_kernel),
           "down": (dict(h="*bf16", order="*i64", offs="*i32", wts="*bf16", w="*bf16", ys="*bf16", s_h="i32",
                         s_we="i32", s_wn="i32", s_y="i32"), tm._down_kernel)}
    for kind, (sig0, fn) in moe.items():
        for cfg in tm._CONFIGS[kind]:
            bm, bn, bk, w, st = cfg
            for desc in (False, True):
                sig = dict(sig0, w=f"tensordesc<bf16[{bn},{bk}]>") if desc else dict(sig0)
                const = dict(H=2048, I=512, TOPK=8, BM=bm, BN=bn, BK=bk, STAGES=st, PREC=None, DESC=desc)
                rows.append((f"moe {kind}", f"{cfg}{', tma' if desc else ''}", kernel_build(
                    fn, sig, const, w, st, divisible={"s_x", "s_we", "s_wn", "s_h", "s_y"})))
    summ = dict(q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*fp32", cu="*i32", o="*bf16", final="*fp32",
                fac="*fp32", uval="*fp32", s_q="i32", s_k="i32", s_v="i32", scale="fp32")
    for fac, val in ((False, False), (True, False), (True, True)):
        const = dict(H=16, HV=32, K=128, V=128, BK=128, BV=64, BL=16, SQUARINGS=3, L2=True, PREC="tf32x3",
                     FACTORS=fac, NB=4, VALUES=val)
        rows.append(("chunk_summary", f"factors {fac}, values {val}",
                     kernel_build(tsum._chunk_summary_kernel, summ, const, 4, divisible={"s_q", "s_k", "s_v"})))
    # one 64-token chunk (the thirty-first session's query tail, which H200 run 107 measured +1.26 ms)
    const = dict(H=16, HV=32, K=128, V=128, BK=128, BV=64, BL=64, SQUARINGS=5, L2=True, PREC="tf32x3", FACTORS=True,
                 NB=4, VALUES=True)
    for nb, w in ((4, 4), (1, 4), (1, 8)):
        rows.append(("chunk_summary", f"64 rows, factors and values, {nb} blocks a program, warps {w}",
                     kernel_build(tsum._chunk_summary_kernel, summ, dict(const, NB=nb), w,
                                  divisible={"s_q", "s_k", "s_v"})))
    # the compose pass's small ops fused (38th session): the per-head norms (query and key with RoPE over 64 of 256
    # columns; the gated output norm at 128), the conv with its raw rows in place and its window, the GDN gate with
    # sigmoid(b), act(gate) * up (the attention's output gate: 16 heads of 256)
    from hypic.ops import triton_conv as tc, triton_gates as tg, triton_norm as tn

    norm = dict(x="*bf16", g="*bf16", w="*fp32", y="*bf16", cs="*bf16", sn="*bf16", T="i32", eps="fp32",
                x_group="i32", xs0="i32", xs1="i32", g_group="i32", gs0="i32", gs1="i32", y_group="i32", ys0="i32",
                ys1="i32", cs_stride="i32")
    for kind, r, d in ((0, 64, 256), (0, 0, 256), (1, 0, 128), (2, 0, 128)):
        bd, bt, w = tn._config(d)
        rows.append(("norm_rows", f"kind {kind}, rope {r}, width {d}", kernel_build(
            tn._norm_rows, norm, dict(D=d, BD=bd, BT=bt, KIND=kind, SILU=True, R=r), w)))
    bd, bt, w = tn._config(2048)              # the residual add with the norm (39th session): the 35B's hidden size
    rows.append(("add_norm_rows", "width 2048", kernel_build(
        tn._add_norm_rows, dict(x="*bf16", r="*bf16", w="*fp32", s="*bf16", y="*bf16", T="i32", eps="fp32"),
        dict(D=2048, BD=bd, BT=bt), w)))
    conv = dict(src="*bf16", raw="*bf16", idx="*i64", weight="*bf16", bias="*bf16", out="*bf16", win="*bf16",
                last="*i64", C="i32", split="i32", raw_stride="i32")
    for in_place in (False, True):
        rows.append(("conv", "raw rows in place, window" if in_place else "from the buffer", kernel_build(
            tc._conv_kernel, conv, dict(W=4, BW=4, BC=256, HAS_BIAS=False, SILU=True, RAW=in_place, WIN=in_place), 4)))
    rows.append(("gate_beta", "32 value heads", kernel_build(
        tg._gate_beta_kernel, dict(a="*bf16", b="*bf16", a_log="*fp32", dt_bias="*fp32", g="*fp32", beta="*bf16",
                                   N="i32", sa="i32", sb="i32"), dict(H=32, BH=32, BN=64), 4)))
    rows.append(("act_mul", "sigmoid, 16 heads of 256", kernel_build(
        tg._act_mul_kernel, dict(gate="*bf16", up="*bf16", out="*bf16", N="i32", HD="i32", g0="i32", g1="i32",
                                 u0="i32", u1="i32"), dict(D=256, BN=2, BD=1024, SILU=False), 4)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernel_resources.json"))
    args = ap.parse_args()
    builds = [("dense", dict()), ("dense", dict(stages=1)), ("factored", dict(factors=True)),
              ("factored", dict(factors=True, stages=1)), ("split", dict(factors=True, split=True, stages=1)),
              ("split", dict(factors=True, split=True)), ("split", dict(factors=True, split=True, stages=1, warps=4)),
              ("split", dict(factors=True, split=True, stages=1, bv=16, warps=4))]
    rows = []
    print("| form | (value block, warps, stages) | registers | spill stores / loads (bytes) | shared memory | runs on an H200 |")
    print("|---|---|---:|---|---:|---|")
    for form, kw in builds:
        cfg = (kw.get("bv", 32), kw.get("warps", 8), kw.get("stages", 2))
        r = dict(form=form, config=list(cfg), **scan_build(**kw))
        rows.append(r)
        print(f"| {form} | {cfg} | {r['registers']} | {r['spill_store_bytes']} / {r['spill_load_bytes']} | "
              f"{r['shared'] / 1024:.0f} KB | {'yes' if r['shared'] <= SMEM_LIMIT else 'no (shared memory)'} |",
              flush=True)
    print("\n| kernel | configuration | registers | spill stores (bytes) | shared memory |")
    print("|---|---|---:|---:|---:|")
    others = []
    for name, cfg, (regs, spill, shared) in other_builds():
        others.append(dict(kernel=name, config=cfg, registers=regs, spill_store_bytes=spill, shared=shared))
        print(f"| {name} | {cfg} | {regs} | {spill} | {shared / 1024:.0f} KB |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(target="cuda sm_90a (ptxas of the installed Triton)", rows=rows,
                                              others=others), indent=1))


if __name__ == "__main__":
    main()
